"""Graders: trusted programs that EVAL runs in a fresh sandbox (see
:mod:`prorl_farm.sandbox.isolated`). They use the standard library only (the repository
tests' one adds pytest), run isolated (``python3 -I``), and print their verdict on their
own stdout in a way no program under test can forge."""

from pathlib import Path

INCLUDE = "# include: "
INCLUDE_TEXT = "# include-text: "


def source(name: str, read=None) -> str:
    """The text of a grader script (:func:`assemble`), read once per process."""
    if read is not None:
        return assemble(name, read)
    if name not in _SOURCES:
        _SOURCES[name] = assemble(name)
    return _SOURCES[name]


_SOURCES: dict[str, str] = {}


def assemble(name: str, read=None) -> str:
    """The text of a grader script shipped with the farm (e.g. ``code_harness.py``), with
    each ``# include: NAME`` line replaced by that file's text (a grader runs with nothing
    importable beside it), and each ``# include-text: NAME VARIABLE`` line by an assignment
    of that text to VARIABLE (code a grader hands to ``python3 -c``). ``read``: name -> text
    (default: the files beside this one; a benchmark reads another revision's)."""
    read = read or (lambda n: (Path(__file__).parent / n).read_text())
    out = []
    for line in read(name).splitlines(keepends=True):
        if line.startswith(INCLUDE):
            out.append(assemble(line[len(INCLUDE):].strip(), read))
        elif line.startswith(INCLUDE_TEXT):
            included, variable = line[len(INCLUDE_TEXT):].split()
            out.append(f"{variable} = {assemble(included, read)!r}\n")
        else:
            out.append(line)
    return "".join(out)
