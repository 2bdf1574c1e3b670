"""Graders: trusted programs that EVAL runs in a fresh sandbox (see
:mod:`prorl_farm.sandbox.grading`). They use the standard library only (the repository
tests' one adds pytest), run isolated (``python3 -I``), and print their verdict on their
own stdout in a way no program under test can forge."""

from pathlib import Path


def source(name: str) -> str:
    """The text of a grader script shipped with the farm (e.g. ``code_harness.py``)."""
    return (Path(__file__).parent / name).read_text()
