"""A corpus of final answers for the ``math`` and ``stem`` graders: right answers written
in another format than their reference (each must earn 1.0), and near-misses in the same
formats (each must earn 0). Deterministic: the same lists in every run.

Each case is ``(kind, reference, final_text, right)``: ``kind`` ``math`` or ``choice``
(four choices), ``final_text`` the whole final message as a policy would end it.
``tests/test_answers.py`` holds the farm's grader to every case; ``bench/answers.py``
reports the false zeros and false ones of the farm's grader and of math-verify alone.
"""

from __future__ import annotations

import random

# -- numbers ----------------------------------------------------------------------------


def _grouped(n: int, sep: str) -> str:
    return f"{n:,}".replace(",", sep)


THOUSANDS = [",", "{,}", "\\,", "\\ ", "\\;"]


def _number_formats(n: int) -> list[str]:
    """Right answers for the integer ``n`` (>= 1000): grouped, currency, wrapped, units."""
    g = _grouped(n, ",")
    return [*(_grouped(n, s) for s in THOUSANDS),
            f"\\${g}", f"\\${n}", f"\\${g}.00", f"{g}\\text{{ dollars}}", f"\\text{{{g}}}",
            f"\\textbf{{{g}}}", f"{n}.0", f"{g} \\text{{ cm}}", f"\\mathbf{{{n}}}"]


def _small_formats(n: int) -> list[str]:
    """Right answers for a small integer ``n``: units, degrees, wrappers, decimals."""
    return [f"{n}\\text{{ cm}}", f"{n} \\text{{ meters}}", f"{n}^\\circ", f"{n}^{{\\circ}}",
            f"\\text{{{n}}}", f"\\textbf{{{n}}}", f"\\mathrm{{{n}}}", f"{n}.0", f"\\${n}",
            f"{n}\\,\\text{{kg}}"]


FRACTIONS = [  # (reference, right answers)
    ("\\frac{1}{2}", ["0.5", "1/2", "\\dfrac{1}{2}", "\\tfrac12", "\\frac12", "\\text{0.5}"]),
    ("\\frac{3}{4}", ["0.75", "3/4", "\\dfrac{3}{4}", "\\frac34", "75\\%"]),
    ("\\frac{2}{3}", ["\\dfrac{2}{3}", "2/3", "\\frac{4}{6}", "\\tfrac{2}{3}"]),
    ("\\sqrt{2}", ["\\sqrt2", "2^{1/2}", "\\sqrt{2}\\text{ units}"]),
    ("2\\sqrt{3}", ["\\sqrt{12}", "2 \\sqrt{3}", "2\\sqrt3"]),
    ("\\pi", ["\\pi", "1\\pi"]),
    ("x+1", ["1+x", "x + 1", "(x+1)"]),
    ("2x", ["2 x", "x\\cdot 2", "x+x"]),
    ("25\\%", ["25\\%", "25 \\%", "25\\text{\\%}", "0.25"]),
    ("12.5", ["12.50", "\\frac{25}{2}", "25/2"]),
]
FRACTION_MISSES = [  # (reference, near-misses)
    ("\\frac{1}{2}", ["0.05", "2", "1/3", "\\frac{1}{4}"]),
    ("\\frac{3}{4}", ["0.7", "4/3", "7.5"]),
    ("\\frac{2}{3}", ["0.6", "3/2", "\\frac{2}{5}"]),
    ("\\sqrt{2}", ["2", "\\sqrt{3}", "1.4"]),
    ("2\\sqrt{3}", ["\\sqrt{6}", "3\\sqrt{2}"]),
    ("\\pi", ["2\\pi", "3"]),
    ("x+1", ["x-1", "x", "2x+1"]),
    ("2x", ["x^2", "2"]),
    ("25\\%", ["2.5", "250", "25.1\\%"]),
    ("12.5", ["125", "1.25", "12"]),
    ("(10,100)", ["10100", "(10,10)", "(100,10)"]),
    ("[1,3]", ["[1,2]", "(0,3)"]),
]


def _number_misses(n: int) -> list[str]:
    """Near-misses for ``n``: another number in the right answers' dress."""
    other = [n + 1, n - 1, n * 10, n // 10, n + 1000]
    out = []
    for i, m in enumerate(other):
        sep = THOUSANDS[i % len(THOUSANDS)]
        out.append(_grouped(m, sep))
    g = _grouped(n + 100, ",")
    out += [f"\\${g}", f"\\text{{{_grouped(n - 10, ',')}}}", f"{_grouped(n, ',')}, {n + 1}"]
    return out


def _hedges(n: int) -> list[str]:
    """Answers that name the reference among others, or around it: a policy hedging its bet
    must not be paid for the one right guess among several."""
    return [f"{n} \\text{{ or }} {n + 1}", f"\\{{{n - 1}, {n}\\}}", f"{n} \\pm 1",
            f"{n - 1} \\le x \\le {n + 1}", f"[{n - 1}, {n + 1}]", f"{n}, {n}",
            f"{n}\\text{{ (or {n + 1})}}", f"x \\in \\{{{n}, {n + 2}\\}}"]


def _small_misses(n: int) -> list[str]:
    return [f"{n + 1}\\text{{ cm}}", f"{n - 1}^\\circ", f"\\text{{{n + 2}}}",
            f"\\textbf{{{n * 2}}}", f"{n}.5", f"\\${n + 10}", f"{n} or {n + 1}"]


# -- choices ----------------------------------------------------------------------------

CHOICE_DRESS = [  # how a letter X is written in a final message (boxed or not)
    "\\boxed{X}", "\\boxed{(X)}", "\\boxed{X.}", "\\boxed{X)}", "\\boxed{\\text{X}}",
    "\\boxed{\\textbf{X}}", "\\boxed{\\mathrm{X}}", "\\boxed{\\text{(X)}}", "\\boxed{[X]}",
    "\\boxed{\\textbf{(X)}}", "\\boxed{**X**}", "\\boxed{Option X}", "\\boxed{\\text{Answer: X}}",
    "The answer is X.", "The answer is (X).", "The correct answer is **X**.", "Answer: X",
    "Answer: (X)", "\\boxed{$X$}", "\\boxed{ X }",
]
CHOICE_MISSES = [  # never one letter: several, or a word
    "\\boxed{X or Y}", "\\boxed{X, Y}", "\\boxed{XY}", "\\boxed{\\text{X and Y}}",
    "\\boxed{Option X or Y}",
]


def _message(answer: str) -> str:
    return f"Working it through step by step, the result follows.\n\n\\boxed{{{answer}}}"


def cases() -> list[tuple[str, str, str, bool]]:
    rng = random.Random(20261204)
    out: list[tuple[str, str, str, bool]] = []
    big = sorted({rng.randrange(1000, 10_000_000) for _ in range(40)})
    for n in big:
        for text in _number_formats(n):
            out.append(("math", str(n), _message(text), True))
        for text in _number_misses(n):
            out.append(("math", str(n), _message(text), False))
        out.append(("math", _grouped(n, ","), _message(str(n)), True))  # a grouped reference
    small = sorted({rng.randrange(2, 500) for _ in range(20)})
    for n in small:
        for text in _small_formats(n):
            out.append(("math", str(n), _message(text), True))
        for text in _small_misses(n) + _hedges(n):
            out.append(("math", str(n), _message(text), False))
    for ref, texts in FRACTIONS:
        out += [("math", ref, _message(t), True) for t in texts]
    for ref, texts in FRACTION_MISSES:
        out += [("math", ref, _message(t), False) for t in texts]
    letters = "ABCD"
    for x in letters:
        y = letters[(letters.index(x) + 1) % 4]
        for dress in CHOICE_DRESS:
            out.append(("choice", x, f"Comparing the options.\n\n{dress.replace('X', x)}",
                        True))
            out.append(("choice", x, f"Comparing the options.\n\n{dress.replace('X', y)}",
                        False))
        for dress in CHOICE_MISSES:
            out.append(("choice", x, dress.replace("X", x).replace("Y", y), False))
    return out
