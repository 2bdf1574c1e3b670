"""Answer formats: false zeros and false ones of the ``math``/``stem`` grader on the answer
corpus (``prorl_farm/dev/answer_corpus.py``: right answers in another format than their
reference, and near-misses in the same formats), next to math-verify alone.

  python bench/answers.py [--record]
  python bench/answers.py --peer [--record]

``--peer``: real model outputs (``prorl_farm/dev/model_outputs.py``: 2,638 GSM8K
generations of two published models) graded by the farm and by the peer (their own
harness's verdict), every disagreement listed with who is right; and wrong answers made of
the right ones (off by one, a hedge after the box, a relation, the hundredth as a percent).

"math-verify alone" is math-verify as a trainer would call it without the farm: its own
extraction from the whole final message (``parse(text)``), the reference parsed as written,
``verify``. Multiple-choice cases are graded the same way (math-verify reads a letter as a
symbol). The farm's grader is :func:`prorl_farm.graders.answers.answer` (what the helper
process runs).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import logging
import time

from common import machine, report  # noqa: E402

from prorl_farm.dev import model_outputs  # noqa: E402
from prorl_farm.dev.answer_corpus import cases  # noqa: E402
from prorl_farm.graders.answers import answer  # noqa: E402


def math_verify_alone(reference: str, text: str) -> bool:
    from math_verify import parse, verify

    try:
        gold = parse(f"${reference}$", parsing_timeout=None) or parse(reference,
                                                                      parsing_timeout=None)
        pred = parse(text, parsing_timeout=None)
        return bool(gold and pred and verify(gold, pred, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - an answer it cannot read is not right
        return False


def farm_right(reference: str, text: str) -> bool:
    return answer({"kind": "math", "text": text, "reference": reference,
                   "max_chars": 200})[0] == 1.0


def peer() -> list[str]:
    rows = model_outputs.outputs()
    t = time.monotonic()
    counts = collections.Counter()
    parted = []
    for row in rows:
        peer_says = model_outputs.peer_right(row["pred"], row["gt"])
        farm = farm_right(row["gt"], row["text"])
        alone = math_verify_alone(row["gt"], row["text"])
        counts[(row["model"], "n")] += 1
        counts[(row["model"], "peer")] += peer_says
        counts[(row["model"], "farm")] += farm
        counts[(row["model"], "alone")] += alone
        counts[(row["model"], "alone parts")] += alone != peer_says
        if farm != peer_says:
            parted.append((row, farm))
    wrong = model_outputs.wrong_variants(rows)
    forged = collections.Counter(how for ref, text, how in wrong if farm_right(ref, text))
    kinds = collections.Counter(how for _, _, how in wrong)
    took = time.monotonic() - t
    lines = [f"\n### answers on real model outputs, beside a peer — {datetime.date.today()} — "
             f"{machine()}", "",
             "`bench/answers.py --peer`: the GSM8K test generations two ToRA models published "
             "with their harness (`examples/math-outputs/`), graded by the farm's `math` grader "
             "(boxed), by the peer (that harness's verdict: its extracted answer against the "
             "reference, which reproduces the published accuracies) and by math-verify alone "
             f"({took:.0f} s):", "",
             "| model | outputs | right by the peer | right by the farm | farm and peer part "
             "| math-verify alone parts from the peer |", "|---|---|---|---|---|---|"]
    for model in sorted({r["model"] for r in rows}):
        n = counts[(model, "n")]
        lines.append(f"| {model} | {n} | {counts[(model, 'peer')]} "
                     f"({100 * counts[(model, 'peer')] / n:.1f}%) | {counts[(model, 'farm')]} | "
                     f"{sum(1 for r, _ in parted if r['model'] == model)} | "
                     f"{counts[(model, 'alone parts')]} |")
    lines += ["", "Every disagreement, and who is right:", "",
              "| model | idx | reference | farm | peer | who is right |",
              "|---|---|---|---|---|---|"]
    for row, farm in parted:
        who, why = model_outputs.DISAGREEMENTS.get((row["model"], row["idx"]),
                                                   ("unlisted", "to be read"))
        lines.append(f"| {row['model']} | {row['idx']} | {row['gt']} | {int(farm)} | "
                     f"{int(not farm)} | {who}: {why} |")
    lines += ["", f"Wrong answers made of right ones ({len(wrong)}): "
              + ", ".join(f"{how} {kinds[how]} ({forged[how]} earned 1.0)" for how in kinds)
              + "."]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record", action="store_true")
    p.add_argument("--peer", action="store_true", help="real model outputs beside a peer")
    args = p.parse_args()
    logging.disable(logging.WARNING)  # math-verify warns about its disabled timeouts
    if args.peer:
        report(peer(), args.record)
        return
    counts = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)
    t = time.monotonic()
    for kind, reference, text, right in cases():
        counts[(kind, right, "n")] += 1
        farm = answer({"kind": kind, "text": text, "reference": reference, "max_chars": 200,
                       "n_choices": 4})[0] == 1.0
        alone = math_verify_alone(reference, text)
        for who, says in (("farm", farm), ("alone", alone)):
            if says != right:
                counts[(kind, right, who)] += 1
                if len(examples[who]) < 8:
                    examples[who].append(f"{reference!r} <- {text.splitlines()[-1]!r}")
    took = time.monotonic() - t
    lines = [f"\n### answer formats — {datetime.date.today()} — {machine()}", "",
             "`bench/answers.py`: the answer corpus (`prorl_farm/dev/answer_corpus.py`), "
             f"graded by the farm's grader and by math-verify alone ({took:.0f} s for both):",
             "", "| cases | n | farm: wrong verdicts | math-verify alone: wrong verdicts |",
             "|---|---|---|---|"]
    for kind in ("math", "choice"):
        for right, what in ((True, "right answers (a wrong verdict is a false 0)"),
                            (False, "near-misses (a wrong verdict is a false 1)")):
            n = counts[(kind, right, "n")]
            lines.append(f"| `{kind}`, {what} | {n} | {counts[(kind, right, 'farm')]} | "
                         f"{counts[(kind, right, 'alone')]} |")
    for who, name in (("alone", "math-verify alone"), ("farm", "the farm")):
        if examples[who]:
            lines += ["", f"Some of {name}'s wrong verdicts:", ""]
            lines += [f"- `{e}`" for e in examples[who]]
    report(lines, args.record)


if __name__ == "__main__":
    main()
