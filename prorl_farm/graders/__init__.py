"""Graders: trusted programs that EVAL runs in a fresh sandbox (see
:mod:`prorl_farm.sandbox.grading`). They use the standard library only, run under
``python3 -I -S``, and print their verdict as the last line of their own stdout, which no
program under test can reach."""

from pathlib import Path


def source(name: str) -> str:
    """The text of a grader script shipped with the farm (e.g. ``code_harness.py``)."""
    return (Path(__file__).parent / name).read_text()
