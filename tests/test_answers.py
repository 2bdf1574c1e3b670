"""The ``math``/``stem`` answer grader on answers as policies write them: every right answer
of the corpus (``prorl_farm/dev/answer_corpus.py``: thousands separators, currency, units,
text wrappers, choice letters in their common dress) earns 1.0 and every near-miss 0, and
the formats that earned false zeros before earn 1.0 through the helper process too
(``bench/answers.py`` reports math-verify alone beside the farm)."""

from __future__ import annotations

import logging

import pytest

from prorl_farm.dev.answer_corpus import cases
from prorl_farm.graders.answers import answer, close_helpers, grade, normal_answer


def test_the_corpus_is_large_enough():
    corpus = cases()
    assert sum(1 for c in corpus if c[3]) >= 500
    assert sum(1 for c in corpus if not c[3]) >= 500


def test_every_right_answer_earns_one_and_every_near_miss_zero():
    logging.disable(logging.WARNING)
    try:
        wrong = []
        for kind, reference, text, right in cases():
            reward, why = answer({"kind": kind, "text": text, "reference": reference,
                                  "max_chars": 200, "n_choices": 4})
            if (reward == 1.0) != right:
                wrong.append((reference, text.splitlines()[-1], why))
    finally:
        logging.disable(logging.NOTSET)
    assert not wrong, f"{len(wrong)} wrong verdicts, e.g. {wrong[:10]}"


@pytest.mark.parametrize(("kind", "reference", "boxed"), [
    ("math", "1000", "1,000"), ("math", "1000", "1{,}000"), ("math", "1000", "\\$1,000"),
    ("choice", "B", "\\text{B}"), ("choice", "B", "\\textbf{B}"), ("choice", "B", "B."),
])
def test_the_false_zeros_that_were_reported_earn_one_through_the_helper(kind, reference,
                                                                        boxed):
    try:
        reward, why = grade({"kind": kind, "text": f"So \\boxed{{{boxed}}}",
                             "reference": reference, "max_chars": 200, "n_choices": 4})
    finally:
        close_helpers()  # the helpers this process kept for the next answer
    assert (reward, why) == (1.0, "correct")


def test_separators_leave_lists_and_tuples_alone():
    assert normal_answer("1,000") == "1000"
    assert normal_answer("1{,}000{,}000") == "1000000"
    assert normal_answer("(10,100)") == "(10,100)"  # a point, not ten thousand one hundred
    assert normal_answer("3,4") == "3,4"
    reward, why = answer({"kind": "math", "text": "\\boxed{1,000, 2}", "reference": "1000",
                          "max_chars": 200})
    assert reward == 0.0 and why == "several candidate answers"


def test_a_helper_the_kernel_ends_at_its_cpu_bound_is_a_time_bound_not_a_memory_one(
        monkeypatch):
    """A pool process starved of CPU may not see the bound pass before the kernel's own
    (RLIMIT_CPU) ends the helper with SIGXCPU: that is the time bound, said as such, never
    'the grader died twice'. Stands in for the starvation: the pool never sees CPU spent."""
    from prorl_farm.graders import answers

    monkeypatch.setattr(answers, "_cpu_seconds", lambda pid: 0.0)
    tower = "\\boxed{9^{9^{9^{9}}}}"
    try:
        verdict = grade({"kind": "math", "text": tower, "reference": "4",
                         "max_chars": 10_000}, timeout_s=1.0)
    finally:
        close_helpers()
    assert verdict == (0.0, "grading exceeded its time bound (1 s of CPU)")
