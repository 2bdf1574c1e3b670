"""The ``code`` harness on right programs whose results are not Python literals, and on
stdio output judged by the task's checker: each right program earns every test beside a
wrong one that earns none, in a real grading sandbox with the jail (the harness as EVAL
runs it). And the routes a typed value opens, tried: a program's object asked to judge a
value of the test's, a StopIteration that would end the test's own loop, answers written
ahead of the questions."""

from __future__ import annotations

import pytest

from tests.farm import code_harness_verdict, needs_bwrap_and_git

pytestmark = needs_bwrap_and_git()


def _mbpp(entry: str, *asserts: str) -> dict:
    return {"entry_point": entry, "test_list": list(asserts)}


PAIR = ("class Pair(object):\n    def __init__(self, a, b):\n        self.a = a\n"
        "        self.b = b\n")
CHAIN = ("def max_chain_length(arr, n):\n    mcl = [1] * n\n    for i in range(1, n):\n"
         "        for j in range(i):\n            if arr[i].a > arr[j].b and mcl[i] < mcl[j] + 1:\n"
         "                mcl[i] = mcl[j] + 1\n    return max(mcl)\n")
# (name, right program, wrong program, tests): the right ones earned 0 when results crossed
# the jail as Python literals only, or stdio output was compared as text.
CALLS = [
    ("Counter", "from collections import Counter\ndef f(s):\n    return Counter(s)\n",
     "from collections import Counter\ndef f(s):\n    return Counter(s[1:])\n",
     _mbpp("f", "assert f('aab') == {'a': 2, 'b': 1}",
           "from collections import Counter\nassert f('abb') == Counter('abb')")),
    ("defaultdict", "from collections import defaultdict\ndef f(s):\n    d = defaultdict(int)\n"
     "    for c in s:\n        d[c] += 1\n    return d\n",
     "from collections import defaultdict\ndef f(s):\n    return defaultdict(int)\n",
     _mbpp("f", "assert f('aab') == {'a': 2, 'b': 1}", "assert f('x')['y'] == 0")),
    ("frozenset", "def f(x):\n    return frozenset(x)\n", "def f(x):\n    return frozenset()\n",
     _mbpp("f", "assert f([1, 2]) == frozenset({1, 2})")),
    ("Decimal", "from decimal import Decimal\ndef f(x):\n    return Decimal(x) / 4\n",
     "from decimal import Decimal\ndef f(x):\n    return Decimal(x) / 5\n",
     _mbpp("f", "from decimal import Decimal\nassert f('1') == Decimal('0.25')")),
    ("Fraction", "from fractions import Fraction\ndef f(a, b):\n    return Fraction(a, b)\n",
     "from fractions import Fraction\ndef f(a, b):\n    return Fraction(b, a)\n",
     _mbpp("f", "from fractions import Fraction\nassert f(1, 3) == Fraction(1, 3)")),
    ("dict.keys()", "def f(d):\n    return d.keys()\n", "def f(d):\n    return d.values()\n",
     _mbpp("f", "assert f({1: 2, 3: 4}) == {1, 3}")),
    ("float('inf')", "def f(xs):\n    return max(xs, default=float('inf'))\n",
     "def f(xs):\n    return 10 ** 9\n", _mbpp("f", "assert f([]) == float('inf')")),
    ("5,736 digits", "def f(n):\n    return 10 ** n\n", "def f(n):\n    return 10 ** n + 1\n",
     _mbpp("f", "assert f(5735) == 10 ** 5735", "assert len(str(f(5735))) == 5736")),
    ("generator", "def f(n):\n    for i in range(n):\n        yield i * i\n",
     "def f(n):\n    for i in range(n):\n        yield i\n",
     _mbpp("f", "assert list(f(4)) == [0, 1, 4, 9]",
           "import itertools\nassert list(itertools.islice(f(10 ** 9), 3)) == [0, 1, 4]")),
    ("returned function", "def f(k):\n    return lambda x: x * k\n",
     "def f(k):\n    return lambda x: x + k\n", _mbpp("f", "assert f(3)(4) == 12")),
    ("MBPP 601", PAIR + CHAIN, PAIR + "def max_chain_length(arr, n):\n    return n\n",
     _mbpp("max_chain_length",
           "assert max_chain_length([Pair(5, 24), Pair(15, 25),Pair(27, 40), Pair(50, 60)], 4)"
           " == 3",
           "assert max_chain_length([Pair(1, 2), Pair(3, 4),Pair(5, 6), Pair(7, 8)], 4) == 4",
           "assert max_chain_length([Pair(19, 10), Pair(11, 12),Pair(13, 14), Pair(15, 16), "
           "Pair(31, 54)], 5) == 5")),
    ("sorted in place", "def sort_it(a):\n    a.sort()\n", "def sort_it(a):\n    sorted(a)\n",
     _mbpp("sort_it", "a = [3, 1, 2]\nsort_it(a)\nassert a == [1, 2, 3]")),
    ("expected ValueError", "def f(x):\n    if x < 0:\n        raise ValueError(x)\n    return x\n",
     "def f(x):\n    return x\n",
     _mbpp("f", "try:\n    f(-1)\nexcept ValueError:\n    pass\nelse:\n    assert False")),
]
STDIO = [
    ("0.500000 for 0.5", "print('%.6f' % (1 / 2))", "print('%.6f' % (1 / 3))",
     {"tests": [{"input": "", "output": "0.5\n"}], "checker": "floats"}),
    ("two spaces", "print('1  2')", "print('1  3')", {"tests": [{"input": "", "output": "1 2"}]}),
    ("a leading space", "print(' 1 2')", "print(' 2 1')",
     {"tests": [{"input": "", "output": "1 2\n"}]}),
]
ANY_ORDER = ("import sys\ngot = open(sys.argv[2]).read().split()\n"
             "want = open(sys.argv[3]).read().split()\nsys.exit(0 if sorted(got) == sorted(want)"
             " else 1)\n")


@pytest.mark.parametrize("name,right,wrong,tests", CALLS + STDIO,
                         ids=[c[0] for c in CALLS + STDIO])
def test_a_right_program_earns_every_test_and_a_wrong_one_none(grading_sandbox, name, right,
                                                              wrong, tests):
    good = code_harness_verdict(grading_sandbox, right, tests)
    assert good["passed"] == good["total"] > 0, (name, good)
    bad = code_harness_verdict(grading_sandbox, wrong, tests)
    assert bad["passed"] < bad["total"], (name, bad)
    assert all(r["why"] for r in bad["results"])


def test_a_task_judges_stdio_by_its_own_checker(grading_sandbox):
    """exact compares lines, floats within the tolerance only, a checker program of the
    task's accepts by its exit status; a checker that does not finish is an error (the
    task's fault), never a zero."""
    out = {"tests": [{"input": "", "output": "1 2"}]}

    def verdict(program, **tests):
        return code_harness_verdict(grading_sandbox, program, {**out, **tests})

    assert verdict("print('1  2')", checker="exact")["passed"] == 0
    assert verdict("print('1 2')", checker="exact")["passed"] == 1
    assert verdict("print('1.0000001 2')", checker="floats")["passed"] == 1
    assert verdict("print('1.001 2')", checker="floats")["passed"] == 0
    assert verdict("print('1.001 2')", checker="floats", float_tolerance=0.01)["passed"] == 1
    assert verdict("print('2 1')", checker="program", checker_program=ANY_ORDER)["passed"] == 1
    assert verdict("print('2 3')", checker="program", checker_program=ANY_ORDER)["passed"] == 0
    stuck = verdict("print('2 1')", checker="program", checker_program="while True:\n    pass\n",
                    time_limit_s=0.5)
    assert "checker did not finish" in stuck["error"], stuck


# Programs that reach for a verdict through what typed values open; each earns nothing.
ATTACKS = {
    # A container that says it holds whatever it is asked about.
    "contains-anything": ("class All:\n    def __contains__(self, x):\n        return True\n"
                          "    def __iter__(self):\n        return iter(())\n"
                          "def f(n):\n    return All()\n",
                          _mbpp("f", "assert 7 in f(3)")),
    # StopIteration from the program would end map() early, and all() of nothing is True.
    "stop-the-loop": ("def f(x):\n    raise StopIteration\n",
                      _mbpp("f", "assert all(map(lambda c: f(c[0]) == c[1], [(1, 2), (2, 4)]))")),
    "stop-subclass": ("class Done(StopIteration):\n    pass\ndef f(x):\n    raise Done()\n",
                      _mbpp("f", "assert all(map(lambda c: f(c[0]) == c[1], [(1, 2)]))")),
    # An object of the program's compared with the test's value; an int that says yes.
    "rigged-eq-object": ("class Any:\n    def __eq__(self, o):\n        return True\n"
                         "    __hash__ = object.__hash__\n"
                         "def f(x):\n    return Any()\n", _mbpp("f", "assert f(1) == 2")),
    "rigged-eq-int": ("class Liar(int):\n    def __eq__(self, o):\n        return True\n"
                      "def f(x):\n    return Liar(0)\n", _mbpp("f", "assert f(1) == 2")),
    "rigged-ordering": ("class Big:\n    def __gt__(self, o):\n        return True\n"
                        "    def __lt__(self, o):\n        return True\n"
                        "def f(x):\n    return Big()\n", _mbpp("f", "assert 1 < f(1) < 3")),
    # Answers written ahead of the questions, on the descriptor the answers come by.
    "answers-ahead": ("import os, sys, json\nfd = int(sys.argv[2])\n"
                      "for _ in range(50):\n    os.write(fd, (json.dumps(['ok', True, []]) + "
                      "'\\n').encode())\ndef f(x):\n    return 0\n",
                      _mbpp("f", "assert f(1) == 2")),
    "exit-in-a-call": ("import sys\ndef f(x):\n    sys.exit(0)\n",
                       _mbpp("f", "assert f(1) is None")),
    # The server's encoder replaced, to hand the harness its own exec as a result.
    "harness-exec": ("import sys\nm = sys.modules['__main__']\nreal = m.encode\n"
                     "m.encode = lambda v, ref=None: ['builtin', 'exec'] if v == 'X' else "
                     "real(v, ref)\ndef f(x):\n    return 'X'\n",
                     _mbpp("f", "assert f(1)('import os') is None")),
    # A reference the program never made, in its name table.
    "forged-reference": ("import os, sys, json\nos.write(int(sys.argv[2]), (json.dumps(["
                         "'ready', {'f': ['function', 9999]}]) + '\\n').encode())\n"
                         "def f(x):\n    return 2\n", _mbpp("f", "assert f(1) == 2")),
}


def test_what_typed_values_open_earns_nothing(grading_sandbox):
    for name, (program, tests) in ATTACKS.items():
        verdict = code_harness_verdict(grading_sandbox, program, tests)
        assert verdict.get("passed") == 0, (name, verdict)
        assert all(r["why"] for r in verdict["results"]), (name, verdict)


def test_what_cannot_cross_says_so():
    """A value of the test's with no description (its own function) is an error of that
    test with the reason; so is a program's value nested past the decoder's depth."""
    from prorl_farm.graders.values import Unencodable, encode

    with pytest.raises(Unencodable, match="cannot be carried"):
        encode([lambda: 1])


def test_a_function_of_the_tests_is_refused_with_the_reason(grading_sandbox):
    verdict = code_harness_verdict(grading_sandbox, "def apply(g, x):\n    return g(x)\n",
                                   _mbpp("apply", "assert apply(lambda v: v + 1, 1) == 2"))
    assert verdict["passed"] == 0
    assert "cannot be carried to the program" in verdict["results"][0]["why"], verdict


def test_mbpp_references_earn_one_and_their_stubs_nothing(grading_sandbox):
    """A sample of MBPP's full set (every 40th problem, and those that need a program's
    class in the setup, a type as an argument, the program's sys, a function named check,
    objects built of the program's class): each reference earns 1.0 as under MBPP's own
    harness, and each with its bodies replaced by ``return None`` earns 0
    (``bench/mbpp.py`` grades all 974 and the 427 sanitized)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "humaneval"))
    from rows import mbpp_row, mbpp_rows

    rows = mbpp_rows("full")
    picked = rows[::40] + [r for r in rows if r["task_id"] in (367, 533, 596, 601, 927)]
    picked += [r for r in mbpp_rows("sanitized") if r["task_id"] == 56]
    for row in picked:
        for body, earns in ((None, True), ("return None", False)):
            inst = mbpp_row(row, body)
            tests = {k: inst[k] for k in ("entry_point", "test_list", "test_setup")}
            verdict = code_harness_verdict(grading_sandbox, inst["canonical_solution"], tests)
            assert (verdict.get("passed") == verdict.get("total")) == earns, (
                row["task_id"], body, verdict)
