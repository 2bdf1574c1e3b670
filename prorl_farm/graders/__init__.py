"""Graders: trusted programs that EVAL runs in a fresh sandbox (see
:mod:`prorl_farm.sandbox.grading`). They use the standard library only (the repository
tests' one adds pytest), run isolated (``python3 -I``), and print their verdict on their
own stdout in a way no program under test can forge."""

from pathlib import Path

INCLUDE = "# include: "


def source(name: str) -> str:
    """The text of a grader script shipped with the farm (e.g. ``code_harness.py``), with
    each ``# include: NAME`` line replaced by that file's text (a grader runs with nothing
    importable beside it)."""
    lines = (Path(__file__).parent / name).read_text().splitlines(keepends=True)
    return "".join(source(line[len(INCLUDE):].strip()) if line.startswith(INCLUDE) else line
                   for line in lines)
