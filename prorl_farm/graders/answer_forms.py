"""How a final answer is written, read without evaluating it: the dresses a right answer
takes that math-verify does not read (choice letters with their values, inequalities for
intervals, repeating decimals, digit groups, numbers in words or with units in ``\\text{}``,
numbers in another base, radians for degrees), the unboxed final-answer lines of common
conventions, and the signs of a hedge (a relation between different values, another value
offered after the box).

Pure text: every function here is linear or close to it in its input and computes nothing
unbounded (math-verify, which can, runs in the grading helper of
:mod:`prorl_farm.graders.answers` that calls these).
"""

from __future__ import annotations

import re
from fractions import Fraction

# -- where the answer is ----------------------------------------------------------------


_BRACES = re.compile(r"[{}]")


def last_command(text: str, command: str) -> tuple[str, int] | None:
    """``(content, end)`` of the last ``command{...}`` (``\\boxed``, ``\\fbox``) whose
    first brace is balanced (``end``: just past its closing brace), or None. Linear in the
    text: each brace is matched once, each span searched once."""
    closes, stack = {}, []
    for m in _BRACES.finditer(text):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            closes[stack.pop()] = m.start()
    # Searching back from the last command: ``known`` is the first brace at or after
    # ``limit`` (None: there is none), so each start searches only [start, limit).
    known, limit = None, len(text)
    start = text.rfind(command)
    while start != -1:
        i = text.find("{", start, limit)
        if i == -1:
            if known is None:
                return None
            i = known
        if i in closes:
            return text[i + 1:closes[i]].strip(), closes[i] + 1
        known, limit = i, start
        start = text.rfind(command, 0, start)
    return None


_FINAL_LINE = re.compile(  # "**Answer:** 5", "Answer: 5", "Final answer: 5" (linear: the
    # value's dress of stars and blanks is taken off after the match)
    r"(?im)^[ \t>*_#]*(?:the\s+)?(?:final\s+)?answer(?:\s+is)?[ \t*_]*[:：](.+)$")
_FINAL_PHRASE = re.compile(  # Minerva's "Final Answer: The final answer is $5$. I hope..."
    r"(?i)the\s+final\s+answer\s+is\s*:?\s*(\$[^$\n]{1,400}\$|\\\(.{1,400}?\\\)|[^\n]{1,400}?)"
    r"\s*(?:\.\s*I\s+hope\s+it\s+is\s+correct\.?|\.?\s*$|\.\s)")


def final_line(text: str) -> tuple[str, int] | None:
    """An unboxed final answer of a common convention, as ``(answer, end)``: the last of
    ``\\fbox{...}``, Minerva's "The final answer is $X$.", ``**Answer:** X`` and
    ``Answer: X`` lines; None if there is none."""
    found: list[tuple[int, str, int]] = []  # (where it is, answer, end)
    fbox = last_command(text, "\\fbox")
    if fbox is not None:
        found.append((fbox[1], *fbox))
    for pattern in (_FINAL_PHRASE, _FINAL_LINE):
        matches = list(pattern.finditer(text))
        if matches:
            found.append((matches[-1].start(), matches[-1].group(1), matches[-1].end(1)))
    if not found:
        return None
    _, value, end = max(found)
    value = _bare(value.strip(" \t*_"), ".")
    return (value, end) if value else None


def _bare(value: str, trailing: str) -> str:
    """``value`` out of its math delimiters (``$...$``, ``\\(...\\)``) and blanks, and
    ``trailing`` punctuation off its end."""
    value = value.strip()
    if value.startswith("\\(") and value.endswith("\\)"):
        value = value[2:-2]
    return value.strip().strip("$").strip().rstrip(trailing).strip()


# -- hedges -----------------------------------------------------------------------------

_HEDGE = re.compile(r"(?i)\b(?:or|alternatively|otherwise|possibly|perhaps|maybe)\b"
                    r"(?:\s+(?:else|perhaps|maybe|possibly|even|also|it\s+could\s+be|"
                    r"it\s+might\s+be))?[\s:,]*(\$[^$\n]{1,120}\$|\\\(.{1,120}?\\\)|"
                    r"[-+]?\d[\d.,/]*)")
HEDGE_WINDOW = 400  # characters after the box read for another value


def offered_after(tail: str) -> list[str]:
    """The values that the text after the answer offers in its place ("... or 3",
    "alternatively $4$"): each must equal the answer, or the answer is a hedge."""
    values = []
    for m in _HEDGE.finditer(tail[:HEDGE_WINDOW]):
        value = _bare(m.group(1), ".,")
        if value:
            values.append(value)
    return values


_RELATION = re.compile(r"\\(?:approx|mapsto|to|rightarrow|Rightarrow|longrightarrow|"
                       r"implies|equiv|simeq|sim|cong|doteq)(?![A-Za-z])|≈|→|=")
# What a side that is a constant may hold besides digits and operators: no variable.
_CONSTANT_WORDS = re.compile(r"\\(?:d?frac|tfrac|sqrt|pi|cdot|times|div|left|right|infty|circ|"
                             r"pm|mp|ldots|cdots|dots|%)(?![A-Za-z])|\\[,;:! ]")


def top_level_split(text: str, pattern: re.Pattern) -> list[str]:
    """``text`` split at the matches of ``pattern`` outside braces, brackets and
    parentheses."""
    parts, depth, last = [], 0, 0
    opens, closes = "{[(", "}])"
    i = 0
    while i < len(text):
        c = text[i]
        if c in opens:
            depth += 1
        elif c in closes:
            depth = max(0, depth - 1)
        elif depth == 0:
            m = pattern.match(text, i)
            if m and m.end() > i:
                parts.append(text[last:i])
                last = i = m.end()
                continue
        i += 1
    parts.append(text[last:])
    return parts


def relation_sides(text: str) -> list[str]:
    """The sides of a relation (``=``, ``\\approx``, ``\\mapsto``, ``\\to``...) at the top
    level of ``text``; one side if it holds none."""
    return [s.strip() for s in top_level_split(text, _RELATION)]


def is_constant(side: str) -> bool:
    """Whether a side names no variable: digits, operators and constants only (``3``,
    ``\\frac{\\pi}{2}``, ``1, 2``), unlike ``x``, ``f(2)`` or ``2x``."""
    rest = _CONSTANT_WORDS.sub("", side)
    return bool(side.strip()) and re.search(r"\d", side) is not None \
        and re.search(r"[A-Za-z\\]", rest) is None


_PERCENT = re.compile(r"\\%|%|\\text\{\s*percent\s*\}|\bpercent\b")


def has_percent(text: str) -> bool:
    return bool(_PERCENT.search(text))


def without_percent(text: str) -> str:
    return _PERCENT.sub("", text).strip()


# -- dresses of a value -----------------------------------------------------------------

_LETTERS = "A-E"  # AMC's five choices
_CHOICE_ALONE = re.compile(rf"\(?\s*([{_LETTERS}])\s*\)?\s*[.:]?")
_CHOICE_FIRST = re.compile(rf"(?:\(\s*([{_LETTERS}])\s*\)|([{_LETTERS}])\s*[).:])\s*(.+)",
                           re.S)
_CHOICE_LAST = re.compile(rf"(.+?)\s+\(\s*([{_LETTERS}])\s*\)", re.S)


def choice_parts(text: str) -> tuple[str | None, str | None]:
    """``(letter, value)`` of an answer in an AMC/AIME choice dress: ``(C) 5``,
    ``\\textbf{(C) } 5``, ``C) 5``, ``5 (C)``; a lone letter is ``(letter, None)``, anything
    else ``(None, text)``. ``text`` has its wrappers already taken off."""
    text = text.strip().strip("$").strip()
    m = _CHOICE_ALONE.fullmatch(text)
    if m:
        return m.group(1), None
    m = _CHOICE_FIRST.fullmatch(text)
    if m:
        return m.group(1) or m.group(2), m.group(3).strip()
    m = _CHOICE_LAST.fullmatch(text)
    if m:
        return m.group(2), m.group(1).strip()
    return None, text


_LESS = r"<|\\lt(?![A-Za-z])|\\le(?:q|qslant)?(?![A-Za-z])|≤"
_GREATER = r">|\\gt(?![A-Za-z])|\\ge(?:q|qslant)?(?![A-Za-z])|≥"
_INEQUALITY = re.compile(rf"(?:{_LESS}|{_GREATER})")
_VARIABLE = re.compile(r"\s*[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?\s*")


def _strict(op: str) -> bool:
    return op in ("<", ">", "\\lt", "\\gt")


def as_interval(text: str) -> str | None:
    """An inequality in one variable as the interval it describes (``1 \\le x < 2`` ->
    ``[1,2)``, ``x > 3`` -> ``(3,\\infty)``), or None if ``text`` is not one."""
    ops = _INEQUALITY.findall(text)
    parts = [p.strip() for p in _INEQUALITY.split(text)]
    if not 1 <= len(ops) <= 2 or any(not p for p in parts):
        return None
    less = [bool(re.fullmatch(_LESS, op)) for op in ops]
    if len(ops) == 2:
        if less[0] != less[1] or not _VARIABLE.fullmatch(parts[1]):
            return None
        low, high, low_op, high_op = parts[0], parts[2], ops[0], ops[1]
        if not less[0]:
            low, high, low_op, high_op = parts[2], parts[0], ops[1], ops[0]
        return (f"{'(' if _strict(low_op) else '['}{low},{high}"
                f"{')' if _strict(high_op) else ']'}")
    left, right = parts
    if _VARIABLE.fullmatch(left) and not _VARIABLE.fullmatch(right):
        bound, below = right, less[0]  # x < 3: below the bound
    elif _VARIABLE.fullmatch(right) and not _VARIABLE.fullmatch(left):
        bound, below = left, not less[0]  # 3 > x: below the bound
    else:
        return None
    if below:
        return f"(-\\infty,{bound}{')' if _strict(ops[0]) else ']'}"
    return f"{'(' if _strict(ops[0]) else '['}{bound},\\infty)"


def ungroup_spaces(text: str) -> str | None:
    """``1 000`` / ``12 345.5`` (digits grouped by thousands with plain spaces) as one
    number; None if ``text`` is not that."""
    m = re.fullmatch(r"\s*([-+]?\d{1,3}(?: \d{3})+)(\.\d+)?\s*", text)
    return m.group(1).replace(" ", "") + (m.group(2) or "") if m else None


_REPEATING = [
    re.compile(r"([-+]?)(\d*)\.(\d*)\\(?:overline|bar|dot)\s*\{(\d+)\}"),
    re.compile(r"([-+]?)(\d*)\.(\d*)\\(?:overline|bar|dot)\s*(\d)"),
    re.compile(r"([-+]?)(\d*)\.(\d*)\((\d+)\)"),
]


def repeating_decimal(text: str) -> str | None:
    """A repeating decimal (``0.\\overline{3}``, ``0.\\bar{3}``, ``0.1\\dot{6}``,
    ``0.(3)``) as the fraction it is (``\\frac{1}{3}``); None if ``text`` is not one."""
    text = text.strip()
    for pattern in _REPEATING:
        m = pattern.fullmatch(text)
        if m:
            sign, whole, fixed, period = m.groups()
            value = Fraction(int(whole or "0"))
            if fixed:
                value += Fraction(int(fixed), 10 ** len(fixed))
            value += Fraction(int(period), (10 ** len(period) - 1) * 10 ** len(fixed))
            if sign == "-":
                value = -value
            return f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
    return None


_UNITS = re.compile(r"\s*([-+]?\d[\d.,]*)\s+([A-Za-z][A-Za-z .'-]{0,40})\s*")
_ONES = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen".split())}
_TENS = {w: 10 * i for i, w in enumerate(
    "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()) if w != "_"}
_SCALES = {"hundred": 100, "thousand": 1000, "million": 10 ** 6, "billion": 10 ** 9}


def words_number(words: list[str]) -> tuple[int | None, int]:
    """The number that the leading words spell (``twenty-one``, ``one hundred and five``)
    and how many words it took; ``(None, 0)`` if the first word is not a number's."""
    total, current, used, seen = 0, 0, 0, False
    for i, word in enumerate(words):
        if word in _ONES:
            current += _ONES[word]
        elif word in _TENS:
            current += _TENS[word]
        elif word == "hundred" and seen:
            current *= 100
        elif word in _SCALES and seen:
            total += current * _SCALES[word]
            current = 0
        elif word == "and" and seen and i + 1 < len(words):
            continue
        else:
            break
        seen, used = True, i + 1
    return (total + current, used) if seen else (None, 0)


def plain_number(text: str) -> str | None:
    """A number written with words around or for it, when the reference is a plain
    number: ``3 apples`` -> ``3``, ``six`` -> ``6``, ``twenty-one dollars`` -> ``21``;
    None if ``text`` is not that."""
    m = _UNITS.fullmatch(text)
    if m and not re.search(r"(?i)\b(?:or|and|to|times|plus|minus|over|divided|of)\b",
                           m.group(2)):
        return m.group(1)
    words = re.findall(r"[a-z]+", text.lower().replace("-", " "))
    if not words or not re.fullmatch(r"[A-Za-z\s-]+", text.strip()):
        return None
    value, used = words_number(words)
    if value is None:
        return None
    rest = words[used:]
    if any(w in ("or", "and", "to", "times", "plus", "minus", "over", "point") or
           w in _ONES or w in _TENS or w in _SCALES for w in rest):
        return None
    return str(value)


_BASED = re.compile(r"\s*\(?\s*([0-9A-Za-z]+)\s*\)?\s*_\s*\{?\s*\(?\s*(\d{1,2})\s*\)?\s*\}?\s*")
_DIGITS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def based(text: str) -> tuple[str, int] | None:
    """``(digits, base)`` of a number written with its base as a subscript (``1011_2``,
    ``(1011)_{2}``, ``\\text{A3}_{16}``), digits upper-cased without leading zeros; None if
    ``text`` is not one or a digit is not of its base."""
    m = _BASED.fullmatch(text)
    if not m:
        return None
    digits, base = m.group(1).upper().lstrip("0") or "0", int(m.group(2))
    if not 2 <= base <= 36 or not _of_base(digits, base):
        return None
    return digits, base


def _of_base(digits: str, base: int) -> bool:
    return all(c in _DIGITS[:base] for c in digits)


def digits_of(text: str, base: int) -> str | None:
    """The digits of ``text`` read in ``base``: its own subscript converted if it names
    another, plain digits as they are; None if they are not digits of ``base``."""
    own = based(text)
    if own is not None:
        value = int(own[0], own[1])
        out = ""
        while True:
            value, digit = divmod(value, base)
            out = _DIGITS[digit] + out
            if not value:
                return out
    digits = text.strip().strip("$").upper().lstrip("0") or "0"
    return digits if _of_base(digits, base) else None


_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\degree|°")


def has_degrees(text: str) -> bool:
    return bool(_DEGREES.search(text))


def without_degrees(text: str) -> str:
    return _DEGREES.sub("", text).strip()


def is_plain_number(text: str) -> bool:
    return bool(re.fullmatch(r"\s*[-+]?(?:\d+\.?\d*|\.\d+)\s*", text))
