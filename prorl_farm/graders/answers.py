"""Grading a final answer (``math``, ``stem``) where it can be bounded and killed.

A policy's answer is text the pool process must never evaluate itself: math-verify turns
``\\boxed{9^{9^{9^{9}}}}`` into an unbounded big-integer computation, which no timeout
inside the process can stop (the computation holds the interpreter), and a long final
message with many ``\\boxed`` is quadratic to scan. So the pool process only ships the
final message and the reference to a *helper process* (``python -m
prorl_farm.graders.answers``: math-verify imported once, a memory limit, lowest
priority), waits for its one-line verdict within a bound of the *helper's CPU time*, and
kills the helper if the bound passes: that answer earns 0 with the reason, the helper is
replaced for the next one, and the pool and every other job go on. The bound is CPU time,
not wall time, because the helper runs at the lowest priority: on a loaded node it may wait
for a core far longer than it computes, and a right answer must not earn 0 for the node's
load (a wall-clock backstop, ``GRADE_WALL_FACTOR`` times the bound, still ends a helper
that never gets to run). The helper also holds each answer to that many seconds of CPU
itself (``RLIMIT_CPU``, a second or two past the bound), so a computation goes even if
the pool process dies under it; a helper the kernel ended for it (``SIGXCPU``, when the
pool process was too starved to see the bound pass first) exceeded its time bound.
It lowers its own priority only once it is ready: importing math-verify at the lowest
priority could take minutes on a busy node.

Helpers are kept between gradings (a per-process pool, one helper per grading in flight);
a helper that dies without a verdict is retried once on a fresh one (what killed it may
not have been the answer), then the answer earns 0 (``grading exceeded its memory bound``).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from prorl_farm.graders import answer_forms as forms
from prorl_farm.graders.ending import end_process
from prorl_farm.sandbox import cgroups

GRADE_TIMEOUT_S = 10.0  # per answer, the helper's CPU seconds (PRORL_GRADE_TIMEOUT_S)
GRADE_WALL_FACTOR = 30.0  # wall-clock backstop: this many times the CPU bound
START_TIMEOUT_S = 300.0  # a helper's start-up (imports), wall clock
GRADE_MEMORY_MB = 1024  # address space of a helper (PRORL_GRADE_MEMORY_MB)
HELPER_CPU_S = 600  # per answer when the request does not say
IDLE_EXIT_S = 120.0  # an unused helper exits
MAX_IDLE_HELPERS = 4


# -- what the helper runs ---------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` whose first brace is balanced, or None."""
    found = forms.last_command(text, "\\boxed")
    return found[0] if found else None


_SEPARATORS = re.compile(r",|;|\bor\b|\\text\{\s*or\s*\}|\\lor")
_ANSWER_LINE = re.compile(r"(?im)^\s*answer\s*[:：]\s*\(?([A-Z])\)?\s*$")
# "The answer is (B)", "the correct answer is: **B**." (the letter a capital, the words any case)
_ANSWER_PHRASE = re.compile(r"(?i:\b(?:the\s+)?(?:final\s+|correct\s+)?answer\s+is)\s*:?\s*"
                            r"[*_]*\(?([A-Z])\)?[*_]*(?=[\s.,;:!)]|$)")
# Digits grouped by thousands: 1,000 / 1{,}000 / 1\,000 / 1\ 000 / 1\;000 / 1~000 (never a
# list: each group after the first has exactly three digits, and nothing but a digit-free
# boundary around them).
_GROUP_SEP = r"(?:,|\{,\}|\\,|\\;|\\:|\\ |~|\\thinspace\s?)"
_GROUPED = re.compile(r"(?<![\d.,}])(\d{1,3}(?:" + _GROUP_SEP + r"\d{3})+)(?![\d]|\{,\}\d)")
_GROUP_SEPS = re.compile(_GROUP_SEP)
# Wrappers that dress a value without changing it: text and font commands.
_WRAPPER = re.compile(r"\\(?:text|textbf|textit|textrm|texttt|mathrm|mathbf|mathit|mathsf|"
                      r"mathtt|mbox|boldsymbol|bm|operatorname)\s*\{([^{}]*)\}")
_CURRENCY = re.compile(r"\\\$|\$|\\(?:text)?(?:dollar|euro|pounds?)\b|(?:USD|US\$|€|£)")


def unwrap(text: str) -> str:
    """``text`` without text and font wrappers (``\\text{B}`` -> ``B``), innermost first."""
    for _ in range(8):
        new = _WRAPPER.sub(lambda m: m.group(1), text)
        if new == text:
            break
        text = new
    return text


_BRACKETED = re.compile(r"[(\[]|\\\{|\\left|\\langle")


def ungroup(text: str) -> str:
    """Thousands separators out of numbers (``1{,}000`` -> ``1000``), nothing else; not in
    a tuple, interval or set, where ``(10,100)`` is two numbers."""
    if _BRACKETED.search(text):
        return text
    return _GROUPED.sub(lambda m: _GROUP_SEPS.sub("", m.group(1)), text)


_NUMBER_WRAPPED = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox)\s*"
                             r"\{(\s*[-+]?[\d.,]+\s*(?:\\?%)?\s*)\}")
_SPACING = re.compile(r"\\[,;:!]|\\ |~")


def normal_answer(text: str) -> str:
    """A boxed answer as math-verify and the candidate count read it best: currency signs
    out, a number out of its text wrapper (``\\text{0.5}``), thousands separators out (so
    that ``1,000`` is one answer, not a list of two), LaTeX spacing (``\\,``) a space."""
    text = _CURRENCY.sub("", text).strip()
    text = _NUMBER_WRAPPED.sub(lambda m: m.group(1), text)
    return _SPACING.sub(" ", ungroup(text))


def grade_math(final_text: str, reference: str, max_chars: int = 200,
               answer_format: str = "boxed") -> tuple[float, str]:
    """(reward, why) for a final message against the reference, by math-verify after the
    answer's dress is read (:mod:`prorl_farm.graders.answer_forms`). ``answer_format``
    ``boxed``: the last ``\\boxed{}``; ``final``: that, or else the last unboxed final
    answer of a common convention. Unbounded: call it in a helper (:func:`grade`), never in
    a pool process."""
    found = forms.last_command(final_text, "\\boxed")
    if found is None and answer_format == "final":
        found = forms.final_line(final_text)
    if found is None:
        return 0.0, "no \\boxed{} answer" if answer_format == "boxed" else "no final answer"
    answer, end = found
    if len(answer) > max_chars:
        return 0.0, f"answer longer than {max_chars} characters"
    answer, reference = normal_answer(answer), normal_answer(reference)
    single = not _SEPARATORS.search(reference)
    if single and _SEPARATORS.search(answer):
        return 0.0, "several candidate answers"
    same = Equal()
    if single and any(not same(v, answer) for v in forms.offered_after(final_text[end:])):
        return 0.0, "another value offered after the answer"
    return compare(answer, reference, same)


class Equal:
    """Whether two answers are the same value, by math-verify (``None``: one of them could
    not be parsed)."""

    def __init__(self):
        from math_verify import parse, verify

        self.parse, self.verify = parse, verify
        self._parsed = {}  # one grading compares the same texts many times: each parsed once

    def parsed(self, text: str):
        if text not in self._parsed:
            self._parsed[text] = (self.parse(f"${text}$", parsing_timeout=None)
                                  or self.parse(text, parsing_timeout=None))
        return self._parsed[text]

    def __call__(self, answer: str, reference: str) -> bool | None:
        gold, pred = self.parsed(reference), self.parsed(answer)
        if not gold or not pred:
            return None
        return bool(self.verify(gold, pred, timeout_seconds=None))


def compare(answer: str, reference: str, same: Equal) -> tuple[float, str]:
    """(reward, why) for a boxed (or final) answer against the reference, both normal."""
    if forms.has_percent(answer) and not forms.has_percent(reference):
        # The reference dropped its unit (GSM8K's "What percentage ...?" has 20, and 27 of
        # 2,638 real right answers box 20\%): x% is read as the number x, and only so; never
        # also as x/100, which would pay a hedge either reading (200% for 2, 75% for 3/4)
        answer = forms.without_percent(answer)
    if len(forms.relation_sides(reference)) == 1:
        sides = forms.relation_sides(answer)
        values = [s for s in sides if forms.is_constant(s)] if len(sides) > 1 else []
        if len(values) > 1 and not all(same(v, values[-1]) for v in values[:-1]):
            return 0.0, "a relation between different values"
        if values:  # x = 3, f(2) = 3, \frac{4}{2} = 2: the value is its constant side
            answer = values[-1]
    plain_answer, plain_reference = unwrap(answer), unwrap(reference)
    letter, value = forms.choice_parts(plain_answer)
    ref_letter, ref_value = forms.choice_parts(plain_reference)
    if letter is not None and (value is not None or ref_letter is None or ref_value is not
                               None):
        verdict = _choice(letter, value, ref_letter, ref_value, same)
        if verdict is not None:
            return (1.0, "correct") if verdict else (0.0, "wrong")
    ok = same(answer, reference)
    if not ok:
        ok = any(same(a, r) for a, r in readings(answer, reference, plain_answer,
                                                  plain_reference))
    if ok is None:
        return 0.0, "answer could not be parsed"
    return (1.0, "correct") if ok else (0.0, "wrong")


def _choice(letter, value, ref_letter, ref_value, same) -> bool | None:
    """A choice answer against the reference: every part both give (letter, value) agrees,
    and they give one at least; None if they share none."""
    shared = False
    if ref_letter is not None:
        if letter != ref_letter:
            return False
        shared = True
    if value is not None and ref_value is not None:
        if not same(value, ref_value):
            return False
        shared = True
    return True if shared else None


def readings(answer: str, reference: str, plain_answer: str, plain_reference: str):
    """Other readings of the answer (and of the reference where the dress is the
    reference's) for math-verify to compare: what a right answer may look like that it
    does not read as its value. Each is tried only where it can be that value."""
    interval_a, interval_r = forms.as_interval(answer), forms.as_interval(reference)
    if interval_a or interval_r:
        yield interval_a or answer, interval_r or reference
    if forms.is_plain_number(plain_reference):
        for reading in (forms.ungroup_spaces(plain_answer), forms.plain_number(plain_answer),
                        forms.repeating_decimal(plain_answer)):
            if reading is not None:
                yield reading, reference
        own = forms.based(plain_answer)
        if own is not None:
            yield str(int(own[0], own[1])), reference
    else:
        fraction = forms.repeating_decimal(plain_answer)
        if fraction is not None:
            yield fraction, reference
    ref_based = forms.based(plain_reference)
    if ref_based is not None:
        digits = forms.digits_of(plain_answer, ref_based[1])
        if digits is not None:
            yield "1" if digits == ref_based[0] else "0", "1"
    if forms.has_degrees(reference) and not forms.has_degrees(answer) and "\\pi" in answer:
        yield f"\\frac{{180}}{{\\pi}}\\left({answer}\\right)", forms.without_degrees(reference)
    if forms.has_degrees(answer) and not forms.has_degrees(reference) and "\\pi" in reference:
        yield f"\\frac{{\\pi}}{{180}}\\left({forms.without_degrees(answer)}\\right)", reference


def choice_letter(picked: str) -> str:
    """The letter of a choice in its common dress: ``B``, ``(B)``, ``B.``, ``B)``, ``[B]``,
    ``\\text{B}``, ``\\textbf{(B)}``, ``**B**``, ``Option B``, ``Answer: B``, ``$B$``;
    anything else is returned as it is (and is not a letter)."""
    text = unwrap(picked).strip().strip("$").strip()
    text = re.sub(r"^(?i:(?:the\s+)?(?:final\s+|correct\s+)?(?:answer|option|choice)"
                  r"(?:\s+is)?\s*[:：]?)\s*", "", text)
    text = text.strip().strip("*_").strip()
    m = re.fullmatch(r"[(\[{]?\s*([A-Za-z])\s*[)\]}]?\s*[.:)]?", text)
    return m.group(1) if m else text


def grade_choice(final_text: str, reference: str, n_choices: int) -> tuple[float, str]:
    """(reward, why) for a multiple-choice answer: one letter, boxed, on an ``Answer:`` line
    or in "the answer is B"."""
    picked = last_boxed(final_text)
    if picked is None:
        lines = _ANSWER_LINE.findall(final_text) or _ANSWER_PHRASE.findall(final_text)
        picked = lines[-1] if lines else None
    if picked is None:
        return 0.0, "no answer"
    letter = choice_letter(picked)
    valid = {chr(ord("A") + i) for i in range(n_choices)}
    if letter.upper() not in valid or len(letter) != 1:
        return 0.0, "not a single choice letter"
    reference = choice_letter(reference)
    return (1.0, "correct") if letter.upper() == reference.strip().upper() else (0.0, "wrong")


def answer(request: dict) -> tuple[float, str]:
    if request["kind"] == "choice":
        return grade_choice(request["text"], request["reference"], request["n_choices"])
    return grade_math(request["text"], request["reference"], request["max_chars"],
                      request.get("answer_format", "boxed"))


def serve() -> None:
    """The helper: one JSON request per stdin line, one ``[reward, why]`` line per answer.
    Each answer may use ``cpu_s`` seconds of CPU (the kernel ends the helper past that,
    even with the pool gone); an idle helper exits after ``IDLE_EXIT_S``."""
    import math_verify  # noqa: F401 - imported once, before the first request

    os.nice(19)  # lowest priority from here on: what runs now is the policy's answer
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    parent = os.getppid()

    def orphaned() -> None:  # the pool process went away: so do we
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()
    stdin = sys.stdin.buffer
    while True:
        ready, _, _ = select.select([stdin], [], [], IDLE_EXIT_S)
        if not ready:
            return
        line = stdin.readline()
        if not line:
            return
        request = json.loads(line)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = math.ceil(usage.ru_utime + usage.ru_stime + request.get("cpu_s", HELPER_CPU_S)) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, resource.RLIM_INFINITY))
        try:
            reward, why = answer(request)
        except MemoryError:
            reward, why = 0.0, "grading exceeded its memory bound"
        except Exception as e:  # noqa: BLE001 - an answer that breaks the parser earns 0
            reward, why = 0.0, f"answer could not be graded ({type(e).__name__})"
        out.write(json.dumps([reward, why]) + "\n")
        out.flush()


# -- the pool process's side ------------------------------------------------------------


def _helper_limits(memory_mb: int) -> None:
    mem = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class Helper:
    """One helper process and its pipes."""

    def __init__(self, memory_mb: int = GRADE_MEMORY_MB, timeout_s: float = START_TIMEOUT_S):
        self.memory_mb = memory_mb
        self.ended = False  # its output ended: it exited (or was killed) by itself
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prorl_farm.graders.answers"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            preexec_fn=lambda: _helper_limits(memory_mb), start_new_session=True,
            close_fds=True)
        if self._line(timeout_s, None) != "ready":
            self.kill()
            raise RuntimeError("the answer grader did not start")

    def _line(self, timeout_s: float, check: Callable[[], None] | None,
              cpu_s: float | None = None) -> str | None:
        """The next line, or None if the helper died, ``timeout_s`` (wall clock) passed, or
        the helper spent more than ``cpu_s`` seconds of CPU since the call."""
        end = time.monotonic() + timeout_s
        spent = _cpu_seconds(self.proc.pid) if cpu_s is not None else 0.0
        fd = self.proc.stdout
        while True:
            if check is not None:
                check()
            left = end - time.monotonic()
            if left <= 0:
                return None
            if cpu_s is not None and _cpu_seconds(self.proc.pid) - spent > cpu_s:
                return None
            ready, _, _ = select.select([fd], [], [], min(left, 0.2))
            if ready:
                line = fd.readline()
                if not line:
                    self.ended = True
                    return None
                return line.decode().rstrip("\n")

    def ask(self, request: dict, cpu_s: float, check) -> tuple[float, str] | None:
        """The verdict, or None if the helper died or spent ``cpu_s`` of CPU (or
        ``GRADE_WALL_FACTOR`` times that of wall clock) without one."""
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            self.ended = True
            return None
        line = self._line(cpu_s * GRADE_WALL_FACTOR, check, cpu_s)
        if line is None:
            return None
        reward, why = json.loads(line)
        return float(reward), str(why)

    def exit_code(self) -> int | None:
        """How the helper ended, once its output did (None: it has not, within seconds)."""
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        end_process(self.proc)


def _cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, IndexError, ValueError):
        return 0.0


_TICKS = os.sysconf("SC_CLK_TCK")
_idle: list[Helper] = []
_lock = threading.Lock()


def _take(memory_mb: int) -> Helper:
    with _lock:
        while _idle:
            helper = _idle.pop()
            if helper.alive() and helper.memory_mb == memory_mb:
                return helper
            helper.kill()
    return Helper(memory_mb)


def _give(helper: Helper) -> None:
    with _lock:
        if helper.alive() and len(_idle) < MAX_IDLE_HELPERS:
            _idle.append(helper)
            return
    helper.kill()


@atexit.register
def close_helpers() -> None:
    with _lock:
        helpers, _idle[:] = list(_idle), []
    for helper in helpers:
        helper.kill()


def grade(request: dict, timeout_s: float = GRADE_TIMEOUT_S,
          check: Callable[[], None] | None = None,
          memory_mb: int = GRADE_MEMORY_MB, cpu_group: str = "") -> tuple[float, str]:
    """(reward, why) for ``request`` (``kind`` ``math``: text, reference, max_chars; or
    ``choice``: text, reference, n_choices), graded in a helper process within
    ``timeout_s`` of the helper's CPU time. ``check`` (e.g. ``ctx.check``) runs while
    waiting and may raise to abandon the grading (the helper is then killed).
    ``cpu_group``: the CPU group (the job's tenant's) the helper grades in."""
    for attempt in (1, 2):
        helper = _take(memory_mb)
        if cpu_group:  # a helper kept idle may last have graded for another tenant
            cgroups.join(cpu_group, helper.proc.pid)
        try:
            verdict = helper.ask({**request, "cpu_s": timeout_s}, timeout_s, check)
        except BaseException:
            helper.kill()
            raise
        if verdict is not None:
            _give(helper)
            return verdict
        # Our bound passed (we kill the helper), or the helper ended by itself: at the
        # kernel's bound (SIGXCPU: this process was too starved to see ours pass first, a
        # time bound too) or for another reason (memory, most likely).
        timed_out = not helper.ended or helper.exit_code() == -signal.SIGXCPU
        helper.kill()
        if timed_out:
            return 0.0, f"grading exceeded its time bound ({timeout_s:g} s of CPU)"
        if attempt == 2:
            return 0.0, "grading exceeded its memory bound (the grader died twice)"
    raise AssertionError("unreachable")


def answer_format_field():
    """The instance field saying where a final answer is: ``boxed`` (the default: the last
    ``\\boxed{}``) or ``final`` (that, or else an unboxed final-answer line)."""
    from marshmallow import fields, validate

    return fields.String(load_default="boxed", validate=validate.OneOf(ANSWER_FORMATS))


ANSWER_FORMATS = ("boxed", "final")


def grade_for(ctx, request: dict) -> tuple[float, str]:
    """:func:`grade` within the farm's bounds (``PRORL_GRADE_*``) and the job's cancel and
    deadline."""
    settings = ctx.settings
    return grade(request, getattr(settings, "grade_timeout_s", GRADE_TIMEOUT_S), ctx.check,
                 getattr(settings, "grade_memory_mb", GRADE_MEMORY_MB),
                 getattr(ctx, "cpu_group", ""))


if __name__ == "__main__":
    serve()
