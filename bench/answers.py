"""Answer formats: false zeros and false ones of the ``math``/``stem`` grader on the answer
corpus (``prorl_farm/dev/answer_corpus.py``: right answers in another format than their
reference, and near-misses in the same formats), next to math-verify alone.

  python bench/answers.py [--record]

"math-verify alone" is math-verify as a trainer would call it without the farm: its own
extraction from the whole final message (``parse(text)``), the reference parsed as written,
``verify``. Multiple-choice cases are graded the same way (math-verify reads a letter as a
symbol). The farm's grader is :func:`prorl_farm.graders.answers.answer` (what the helper
process runs).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import logging
import time

from common import machine, report  # noqa: E402

from prorl_farm.dev.answer_corpus import cases  # noqa: E402
from prorl_farm.graders.answers import answer  # noqa: E402


def math_verify_alone(reference: str, text: str) -> bool:
    from math_verify import parse, verify

    try:
        gold = parse(f"${reference}$", parsing_timeout=None) or parse(reference,
                                                                      parsing_timeout=None)
        pred = parse(text, parsing_timeout=None)
        return bool(gold and pred and verify(gold, pred, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - an answer it cannot read is not right
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record", action="store_true")
    args = p.parse_args()
    logging.disable(logging.WARNING)  # math-verify warns about its disabled timeouts
    counts = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)
    t = time.monotonic()
    for kind, reference, text, right in cases():
        counts[(kind, right, "n")] += 1
        farm = answer({"kind": kind, "text": text, "reference": reference, "max_chars": 200,
                       "n_choices": 4})[0] == 1.0
        alone = math_verify_alone(reference, text)
        for who, says in (("farm", farm), ("alone", alone)):
            if says != right:
                counts[(kind, right, who)] += 1
                if len(examples[who]) < 8:
                    examples[who].append(f"{reference!r} <- {text.splitlines()[-1]!r}")
    took = time.monotonic() - t
    lines = [f"\n### answer formats — {datetime.date.today()} — {machine()}", "",
             "`bench/answers.py`: the answer corpus (`prorl_farm/dev/answer_corpus.py`), "
             f"graded by the farm's grader and by math-verify alone ({took:.0f} s for both):",
             "", "| cases | n | farm: wrong verdicts | math-verify alone: wrong verdicts |",
             "|---|---|---|---|"]
    for kind in ("math", "choice"):
        for right, what in ((True, "right answers (a wrong verdict is a false 0)"),
                            (False, "near-misses (a wrong verdict is a false 1)")):
            n = counts[(kind, right, "n")]
            lines.append(f"| `{kind}`, {what} | {n} | {counts[(kind, right, 'farm')]} | "
                         f"{counts[(kind, right, 'alone')]} |")
    for who, name in (("alone", "math-verify alone"), ("farm", "the farm")):
        if examples[who]:
            lines += ["", f"Some of {name}'s wrong verdicts:", ""]
            lines += [f"- `{e}`" for e in examples[who]]
    report(lines, args.record)


if __name__ == "__main__":
    main()
