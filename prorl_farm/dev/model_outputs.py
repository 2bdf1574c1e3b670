"""Real model outputs for the ``math`` grader, each beside a peer grader's verdict.

``examples/math-outputs/tora-gsm8k.jsonl.gz`` holds the GSM8K test generations two ToRA
models published with their evaluation harness (2 x 1,319: ``model``, ``idx``, ``gt`` the
reference, ``pred`` the answer the harness extracted, ``text`` the whole final message).
The peer is that harness's verdict: its extracted answer against the reference as numbers
within a relative 1e-4, the reference also read as a percent either way (``gt/100``,
``gt*100``), else as text; :func:`peer_right` gives it, and reproduces the accuracies the
harness published (84.3% and 80.7%) to the row count.

``tests/test_answers.py`` holds the farm's grader to the peer on every output but those of
:data:`DISAGREEMENTS`, and to 0 on the wrong answers :func:`wrong_variants` makes of right
ones; ``bench/answers.py --peer`` records both.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from pathlib import Path

OUTPUTS = Path(__file__).resolve().parents[2] / "examples" / "math-outputs" / \
    "tora-gsm8k.jsonl.gz"


def outputs() -> list[dict]:
    with gzip.open(OUTPUTS, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip().rstrip("%").rstrip("\\").strip())
    except ValueError:
        return None


def peer_right(pred: str, gt: str) -> bool:
    p, g = _number(pred), _number(gt)
    if p is not None and g is not None:
        return any(math.isclose(p, x, rel_tol=1e-4) for x in (g / 100, g, g * 100))
    return pred.strip() == gt.strip()


# Where the farm and the peer part, who is right and why, by (model, idx). Every other
# output gets the same verdict from both.
_NO_BOX = "no box: the answer is a sentence after the program's output; the task asks for a box"
_RATE = ("0.7 is the pass rate 70% the reference solution computes; the farm cannot "
         "tell a bare reference is a percent, and reading x as x*100 pays 0.05 for 5 (191)")
DISAGREEMENTS = {
    **{("tora-70b-v1.0", i): ("the farm", _NO_BOX)
       for i in (14, 98, 118, 288, 367, 630, 718, 728, 760)},
    ("tora-code-34b-v1.0", 718): ("the farm", _NO_BOX),
    ("tora-code-34b-v1.0", 191): (
        "the farm", "0.05 pounds a day for 5: wrong; the peer reads the reference as 5%"),
    ("tora-code-34b-v1.0", 806): ("the peer", _RATE),
}

_BOX = re.compile(r"\\boxed\{(-?\d+(?:\.\d+)?)\}")


def wrong_variants(rows: list[dict], per_kind: int = 60) -> list[tuple[str, str, str]]:
    """(reference, text, how) wrong answers made of right ones: the boxed value off by one,
    the box with another value offered after it, a relation between different values in the
    box, and the value as a percent of its hundredth; ``per_kind`` of each."""
    out: list[tuple[str, str, str]] = []
    taken = 0
    for row in rows:
        boxes = _BOX.findall(row["text"])
        if len(boxes) != 1 or _number(boxes[0]) != _number(row["gt"]):
            continue
        value = boxes[0]
        other = str(int(float(value)) + 1)
        box = f"\\boxed{{{value}}}"
        cut = row["text"].index(box) + len(box)
        text = row["text"]
        out += [(row["gt"], text.replace(box, f"\\boxed{{{other}}}"), "off by one"),
                (row["gt"], text[:cut] + f" Or maybe ${other}$." + text[cut:], "hedge after"),
                (row["gt"], text.replace(box, f"\\boxed{{{other} = {value}}}"), "relation"),
                (row["gt"], text.replace(box, f"\\boxed{{{_number(value) * 100:g}\\%}}"),
                 "percent of the hundredth")]
        taken += 1
        if taken == per_kind:
            break
    return out
