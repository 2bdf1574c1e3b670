"""Grade a SWE-bench predictions file through a farm, and report as swebench's harness does.

A predictions file is what a model's SWE-bench run leaves: rows of ``instance_id``,
``model_name_or_path`` and ``model_patch`` (a ``.jsonl``, a ``.json`` list, or a ``.json``
object keyed by instance id, as ``swebench.harness.run_evaluation`` reads them). Each
prediction with a patch becomes a ``swe`` job in reference mode on its dataset row, the
patch in the row's ``patch`` field: the farm grades it exactly as it grades a policy's
change (the screen, the protected files, SWE-bench's tests and verdict). A prediction with
no patch is not run (swebench: ``empty_patch``). A row the farm refuses (an unknown version,
a repository it cannot grade) is an ``error`` with the farm's reason, and so is a job that
fails: never an unresolved instance.

What is written, in swebench 5.0.2's own layout and shapes, under ``report_dir``:

- ``MODEL.RUN_ID.json``: the run report (``make_run_report``'s fields, ``schema_version``
  2), with ``error_reasons`` (the farm's reason for each error id) beside them;
- ``logs/run_evaluation/RUN_ID/MODEL/INSTANCE/report.json``: the instance's report
  (``get_eval_report`` with ``tests_status``), plus a ``farm`` entry (the job, reward,
  verdict, environment, each test's status);
- ``.../test_output.txt``: the test run's log, in the frame of SWE-bench's eval log.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

SCHEMA_VERSION = 2
LOG_DIR = Path("logs") / "run_evaluation"


def read_json_rows(path: str) -> list[dict]:
    """Rows of a ``.jsonl`` file, a ``.json`` list, or a ``.json`` object of rows keyed by
    instance id (its keys become ``instance_id`` where a row has none)."""
    text = Path(path).read_text()
    stripped = text.lstrip()
    if path.endswith(".jsonl") or not stripped.startswith(("[", "{")):
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as e:
                    raise ValueError(f"{path}:{number}: not JSON ({e})") from None
        return rows
    try:
        data = json.loads(text)
    except ValueError:  # a .json file holding JSON lines
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(data, dict):
        if "instance_id" in data:
            return [data]
        return [{"instance_id": key, **value} for key, value in data.items()]
    return list(data)


def read_predictions(path: str) -> dict[str, dict]:
    """``{instance_id: prediction}`` from a predictions file; a row without an
    ``instance_id`` or repeated is refused with its place."""
    out: dict[str, dict] = {}
    for number, row in enumerate(read_json_rows(path), 1):
        if not isinstance(row, dict) or not row.get("instance_id"):
            raise ValueError(f"{path}: prediction {number} has no instance_id")
        if row["instance_id"] in out:
            raise ValueError(f"{path}: instance {row['instance_id']} is predicted twice")
        if "model_patch" not in row:
            raise ValueError(f"{path}: prediction {row['instance_id']} has no model_patch "
                             "(null or \"\" for an empty one)")
        out[row["instance_id"]] = row
    return out


def _model(prediction: dict) -> str:
    return str(prediction.get("model_name_or_path") or "model").replace("/", "__")


def instance_report(instance_id: str, prediction: dict, job: dict | None) -> dict:
    """swebench's ``get_eval_report`` (with ``tests_status``) for one graded prediction,
    and the farm's own word under ``farm``."""
    out = {"patch_is_None": prediction.get("model_patch") is None,
           "patch_exists": prediction.get("model_patch") is not None,
           "patch_successfully_applied": False, "resolved": False}
    if job is None:
        return {instance_id: out}
    result = (job.get("result") or {}).get("eval") or {}
    report = result.get("report")
    if report is not None:  # a status for some test: the patch applied and tests ran
        out["patch_successfully_applied"] = True
        out["resolved"] = bool(result.get("resolved"))
        out["tests_status"] = {**report, "FAIL_TO_FAIL": {"success": [], "failure": []},
                               "PASS_TO_FAIL": {"success": [], "failure": []}}
    out["farm"] = {"job_id": job.get("id"), "state": job.get("state"),
                   "reward": job.get("reward"),
                   "verdict": result.get("verdict") or result.get("invalid"),
                   "suspicious": result.get("suspicious", False),
                   "environment": result.get("environment"), "pinned": result.get("pinned"),
                   "tests": result.get("tests"),
                   "failure": job.get("failure") if job.get("state") != "done" else None}
    return {instance_id: out}


def grade(farm, predictions: dict[str, dict], dataset: list[dict], run_id: str,
          report_dir: str = ".", deadline_s: float = 3600.0, progress: bool | None = None,
          say: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> dict:
    """Grade ``predictions`` of ``dataset`` rows through ``farm`` (a FarmClient); write
    swebench's run report and instance reports under ``report_dir``; return
    ``{"report": run report, "path": its path, "instances": {id: instance report}}``."""
    rows = {row["instance_id"]: row for row in dataset}
    unknown = sorted(set(predictions) - set(rows))
    if unknown:
        raise ValueError(f"{len(unknown)} predicted instance(s) not in the dataset: "
                         f"{', '.join(unknown[:10])}")
    empty = sorted(i for i, p in predictions.items() if p.get("model_patch") in ("", None))
    to_grade = [i for i in rows if i in predictions and i not in empty]
    jobs, errors = _graded_jobs(farm, rows, predictions, to_grade, deadline_s, progress, say)
    instances: dict[str, dict] = {}
    for instance_id in rows:
        prediction = predictions.get(instance_id)
        if prediction is None or instance_id in empty:
            continue
        job = jobs.get(instance_id)
        report = instance_report(instance_id, prediction, job)
        if instance_id in errors:
            report[instance_id].setdefault("farm", {})["error"] = errors[instance_id]
        instances[instance_id] = report
        _write_logs(Path(report_dir) / LOG_DIR / run_id / _model(prediction) / instance_id,
                    report if instance_id not in errors else None, job, prediction)
    report = run_report(predictions, list(rows.values()), instances, errors, empty)
    models = {_model(p) for p in predictions.values()} or {"model"}
    path = Path(report_dir) / f"{'+'.join(sorted(models))}.{run_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=4))
    return {"report": report, "path": str(path), "instances": instances}


def _write_logs(folder: Path, report: dict | None, job: dict | None, prediction: dict) -> None:
    """An instance's folder of logs/run_evaluation as swebench writes it: its report (none
    for an error: swebench's error is a run with no report), the test output, the patch."""
    folder.mkdir(parents=True, exist_ok=True)
    if report is not None:
        (folder / "report.json").write_text(json.dumps(report, indent=4))
    log = ((job or {}).get("result") or {}).get("eval", {}).get("log")
    if log:
        (folder / "test_output.txt").write_text(log)
    (folder / "patch.diff").write_text(prediction.get("model_patch") or "")


def _graded_jobs(farm, rows: dict[str, dict], predictions: dict[str, dict],
                 to_grade: list[str], deadline_s: float, progress: bool | None,
                 say: Callable[[str], None]) -> tuple[dict[str, dict], dict[str, str]]:
    """Each prediction as a reference-mode ``swe`` job: ({instance: finished job},
    {instance: error}). The rows the farm refuses are errors; the rest are submitted once
    the refused are left out."""
    errors: dict[str, str] = {}
    pending = list(to_grade)
    while pending:
        instances = [{**rows[i], "patch": predictions[i]["model_patch"]} for i in pending]
        try:
            batch = farm.submit("swe", instances, mode="reference", deadline_s=deadline_s)
        except Exception as e:  # noqa: BLE001 - a refusal names the instances
            refused = ((getattr(e, "details", None) or {}).get("instances")
                       if getattr(e, "status", None) == 400 else None)
            if not refused:
                raise
            for index, why in refused.items():
                errors[pending[int(index)]] = "refused: " + json.dumps(why)
            pending = [i for n, i in enumerate(pending) if str(n) not in refused
                       and n not in refused]
            continue
        return _collect(farm, batch, pending, deadline_s, progress, say, errors), errors
    return {}, errors


def _collect(farm, batch: dict, pending: list[str], deadline_s: float,
             progress: bool | None, say: Callable[[str], None],
             errors: dict[str, str]) -> dict[str, dict]:
    """The batch's finished jobs by instance, shown as they come (a bar on a terminal);
    a job that did not finish is an error of its instance."""
    by_job = dict(zip(batch["job_ids"], pending))
    jobs: dict[str, dict] = {}
    bar = None
    if progress or (progress is None and sys.stderr.isatty()):
        from tqdm import tqdm

        bar = tqdm(total=len(pending), unit="instance", desc="grading", file=sys.stderr)
    resolved = 0
    for job in farm.iter_results(batch["batch_id"], timeout_s=deadline_s + 120):
        instance_id = by_job[job["id"]]
        jobs[instance_id] = job
        eval_ = (job.get("result") or {}).get("eval") or {}
        if job["state"] != "done":
            failure = job.get("failure") or {}
            errors[instance_id] = f"{job['state']}: {failure.get('kind')}: " \
                                  f"{str(failure.get('message', ''))[:500]}"
        resolved += bool(eval_.get("resolved"))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(resolved=resolved, errors=len(errors))
        else:
            say(f"[{len(jobs)}/{len(pending)}] {instance_id}: "
                + ("resolved" if eval_.get("resolved") else errors.get(instance_id)
                   or (eval_.get("invalid") and f"unresolved ({eval_['invalid']})")
                   or "unresolved"))
    if bar is not None:
        bar.close()
    return jobs


def run_report(predictions: dict, dataset: list[dict], instances: dict, errors: dict,
               empty: list[str]) -> dict:
    """swebench 5.0.2's ``make_run_report`` fields from the graded instances."""
    ids = [row["instance_id"] for row in dataset]
    completed = sorted(i for i in instances if i not in errors)
    resolved = sorted(i for i in completed if instances[i][i]["resolved"])
    unresolved = sorted(i for i in completed if not instances[i][i]["resolved"])
    incomplete = sorted(i for i in ids if i not in predictions)
    return {"total_instances": len(ids), "submitted_instances": len(predictions),
            "completed_instances": len(completed), "resolved_instances": len(resolved),
            "unresolved_instances": len(unresolved), "infra_failure_instances": 0,
            "ambiguous_failure_instances": 0, "empty_patch_instances": len(empty),
            "error_instances": len(errors), "completed_ids": completed,
            "incomplete_ids": incomplete, "empty_patch_ids": sorted(empty),
            "submitted_ids": sorted(predictions), "resolved_ids": resolved,
            "unresolved_ids": unresolved, "infra_failure_ids": [],
            "ambiguous_failure_ids": [], "failure_reasons": {},
            "error_ids": sorted(errors), "error_reasons": dict(sorted(errors.items())),
            "schema_version": SCHEMA_VERSION}


def default_run_id() -> str:
    import time

    return time.strftime("prorl-%Y%m%d-%H%M%S") + f"-{os.getpid()}"
