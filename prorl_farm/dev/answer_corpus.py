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
    ("\\frac{3}{4}", ["0.75", "3/4", "\\dfrac{3}{4}", "\\frac34"]),
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
    # Against a reference without one, a percent sign is the unit the reference dropped:
    # 75% for 3/4 is the number 75 (never also 0.75, which would pay 200% for 2 either
    # reading).
    ("\\frac{3}{4}", ["0.7", "4/3", "7.5", "75\\%"]),
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


# -- dresses math-verify alone does not read (each beside its near-misses) -----------------

_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen "
          "fourteen fifteen sixteen seventeen eighteen nineteen").split()
_TENS_WORDS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def _in_words(n: int) -> str:
    if n < 20:
        return _WORDS[n]
    tens, ones = divmod(n, 10)
    return _TENS_WORDS[tens] + (f"-{_WORDS[ones]}" if ones else "")


def _base(n: int, b: int) -> str:
    out = ""
    while True:
        n, d = divmod(n, b)
        out = "0123456789ABCDEF"[d] + out
        if not n:
            return out


def dresses(rng: random.Random) -> list[tuple[str, str, str, bool]]:
    """Right answers in the dresses of AMC/AIME choices, intervals, repeating decimals,
    digit groups, words, units in ``\\text{}``, bases and angles, each with near-misses in
    the same dress; and hedges (a value offered after the box, a relation between
    different values, and the percent of a number as its hundredth)."""
    out = []
    for n in sorted({rng.randrange(2, 99) for _ in range(12)}):
        letter = "ABCDE"[n % 5]
        other = "ABCDE"[(n + 1) % 5]
        for dress in ("\\textbf{(L) } V", "(L)\\ V", "\\text{L) } V", "(L) V",
                      "\\textbf{(L)}~V", "V \\textbf{(L)}", "\\mathrm{(L)}\\ V"):
            right = dress.replace("L", letter).replace("V", str(n))
            out += [("math", str(n), _message(right), True),
                    ("math", letter, _message(right), True),
                    ("math", f"\\textbf{{({letter})}} {n}", _message(right), True)]
            out += [("math", str(n), _message(dress.replace("L", letter)
                                              .replace("V", str(n + 1))), False),
                    ("math", letter, _message(dress.replace("L", other)
                                              .replace("V", str(n))), False)]
        out += [("math", str(n), _message(f"\\text{{{_in_words(n)}}}"), True),
                ("math", str(n), _message(_in_words(n)), True),
                ("math", str(n), _message(f"\\text{{{_in_words(n + 1)}}}"), False),
                ("math", str(n), _message(f"\\text{{{n} apples}}"), True),
                ("math", str(n), _message(f"\\text{{{n + 1} apples}}"), False),
                ("math", str(n), _message(f"\\text{{{n} or {n + 1} apples}}"), False),
                ("math", str(n), _message(f"{_base(n, 2)}_2"), True),
                ("math", str(n), _message(f"{_base(n, 8)}_{{8}}"), True),
                ("math", str(n), _message(f"{_base(n + 1, 2)}_2"), False),
                ("math", f"{_base(n, 2)}_2", _message(_base(n, 2)), True),
                ("math", f"{_base(n, 2)}_2", _message(str(n)), False),
                ("math", f"{_base(n, 16)}_{{16}}", _message(f"{_base(n, 16)}_{{16}}"), True),
                ("math", f"{_base(n, 16)}_{{16}}", _message(_base(n + 1, 16)), False)]
        # hedges: each names the reference beside another value
        out += [("math", str(n), f"So the answer is \\boxed{{{n}}} or {n + 1}.", False),
                ("math", str(n), f"\\boxed{{{n}}}. Alternatively, ${n + 2}$ also works.",
                 False),
                ("math", str(n), f"\\boxed{{{n}}}, or equivalently $\\frac{{{2 * n}}}{{2}}$.",
                 True),
                ("math", str(n), f"\\boxed{{{n}}}. This is the answer, for {n + 3} reasons.",
                 True),
                ("math", str(n), _message(f"{n} \\approx {n + 1}"), False),
                ("math", str(n), _message(f"{n + 1} = {n}"), False),
                ("math", str(n), _message(f"{n + 1} \\mapsto {n}"), False),
                ("math", str(n), _message(f"f({n + 1}) = {n}"), True),
                ("math", str(n), _message(f"x = {n}"), True),
                ("math", str(n), _message(f"\\frac{{{2 * n}}}{{2}} = {n}"), True),
                ("math", str(n), _message(f"{n}\\%"), True),
                ("math", str(n), _message(f"{100 * n}\\%"), False)]
    for n in sorted({rng.randrange(1000, 999_999) for _ in range(8)}):
        out += [("math", str(n), _message(_grouped(n, " ")), True),
                ("math", str(n), _message(_grouped(n + 1, " ")), False)]
    for num, den in ((1, 3), (2, 3), (1, 6), (5, 6), (1, 7), (4, 11), (7, 12), (1, 9)):
        ref = f"\\frac{{{num}}}{{{den}}}"
        fixed, period = _decimal(num, den)
        for dress in (f"0.{fixed}\\overline{{{period}}}", f"0.{fixed}\\bar{{{period}}}",
                      f"0.{fixed}({period})"):
            out.append(("math", ref, _message(dress), True))
        wrong = str((int(period) + 1) % 10 ** len(period)).zfill(len(period))
        out.append(("math", ref, _message(f"0.{fixed}\\overline{{{wrong}}}"), False))
    for low, high in ((1, 2), (-3, 5), (0, 10)):
        for lo, hi, left, right in (("\\le", "<", "[", ")"), ("<", "\\le", "(", "]"),
                                    ("\\leq", "\\leq", "[", "]"), ("<", "<", "(", ")")):
            ref = f"{left}{low},{high}{right}"
            out.append(("math", ref, _message(f"{low} {lo} x {hi} {high}"), True))
            flip = {"<": "\\le", "\\le": "<", "\\leq": "<"}[lo]
            out.append(("math", ref, _message(f"{low} {flip} x {hi} {high}"), False))
        out += [("math", f"({low},\\infty)", _message(f"x > {low}"), True),
                ("math", f"({low},\\infty)", _message(f"x \\ge {low}"), False),
                ("math", f"(-\\infty,{high}]", _message(f"x \\le {high}"), True),
                ("math", f"(-\\infty,{high}]", _message(f"{high} > x"), False)]
    for degrees, radians in ((90, "\\frac{\\pi}{2}"), (60, "\\frac{\\pi}{3}"),
                             (180, "\\pi"), (45, "\\frac{\\pi}{4}")):
        out += [("math", f"{degrees}^\\circ", _message(radians), True),
                ("math", radians, _message(f"{degrees}^\\circ"), True),
                ("math", f"{degrees}^\\circ", _message(f"2{radians}"), False),
                ("math", radians, _message(f"{degrees + 1}^\\circ"), False)]
    return out


def _decimal(num: int, den: int) -> tuple[str, str]:
    """The fixed digits and the period of ``num/den`` (< 1) in decimal."""
    digits, seen, rest = "", {}, num % den
    while rest and rest not in seen:
        seen[rest] = len(digits)
        rest *= 10
        digits += str(rest // den)
        rest %= den
    start = seen.get(rest, len(digits))
    return digits[:start], digits[start:] or "0"


# Unboxed final answers (``answer_format: final``), each as (reference, text, right).
FINAL_LINES = [
    ("5", "Final Answer: The final answer is $5$. I hope it is correct.", True),
    ("5", "Final Answer: The final answer is $6$. I hope it is correct.", False),
    ("\\frac{1}{2}", "Final Answer: The final answer is $\\frac{1}{2}$. I hope it is correct.",
     True),
    ("5", "Adding them up.\n\n**Answer:** 5", True),
    ("5", "Adding them up.\n\n**Answer:** 6", False),
    ("5", "Adding them up.\nAnswer: 5", True),
    ("5", "Adding them up.\nAnswer: $5$.", True),
    ("5", "Adding them up.\nAnswer: 5 or 6", False),
    ("5", "Adding them up, \\fbox{5}.", True),
    ("5", "Adding them up, \\fbox{7}.", False),
    ("5", "The final answer is 5.", True),
    ("5", "Adding them up gives 5.", False),  # no convention's line: no answer
    ("5", "Answer: 4\nOn second thought, \\boxed{5}", True),  # a box first
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
    out += dresses(rng)
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
