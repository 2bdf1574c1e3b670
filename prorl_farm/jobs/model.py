"""The public view of a job: what the API and the client return."""

from __future__ import annotations

import json

from prorl_farm.columns import table_payload
from prorl_farm.config import STAGES
from prorl_farm.states import TERMINAL_STATES, JobState


def _f(raw: dict, name: str) -> float | None:
    value = raw.get(name)
    return float(value) if value not in (None, "") else None


def stage_timings(raw: dict) -> dict:
    """Per stage: queue wait and active time apart (seconds), where the stage was reached."""
    out = {}
    for stage in STAGES:
        queued, start, end = (_f(raw, f"t_{stage}_{k}") for k in ("queued", "start", "end"))
        if queued is None and start is None:
            continue
        out[stage] = {
            "queue_wait_s": round(start - queued, 6) if start is not None and queued else None,
            "active_s": round(end - start, 6) if end is not None and start is not None else None,
        }
    created, finished = _f(raw, "created_at"), _f(raw, "finished_at")
    if created is not None and finished is not None:
        out["total_s"] = round(finished - created, 6)
    return out


def stored_table(result: dict | None, payloads):
    """A result summary's payload as the trajectory store holds it (its one-row table), or
    None: no payload, no store given, or the payload deleted (acknowledged, expired), which
    the summary then says in ``payload.deleted``."""
    ref = (result or {}).get("payload")
    if payloads is None or not isinstance(ref, dict):
        return None
    table = payloads.read_table(ref)
    if table is None:
        result["payload"] = {**ref, "deleted": True}
    return table


def with_payload(result: dict | None, payloads) -> dict | None:
    """A result summary with its payload read back from the trajectory store (as lists);
    one whose payload is deleted says so in ``payload.deleted`` (:func:`stored_table`)."""
    table = stored_table(result, payloads)
    return result if table is None else {**result, **table_payload(table, 0, as_lists=True)}


def render_job(raw: dict, include_instance: bool = True, payloads=None) -> dict:
    """Turn a job hash into its JSON document; with ``payloads`` (the trajectory store),
    its result carries the trajectory's arrays, else only the summary Redis keeps."""
    state = raw["state"]
    terminal = JobState(state) in TERMINAL_STATES
    failure = None
    if raw.get("failure_kind"):
        failure = {"kind": raw["failure_kind"], "message": raw.get("failure_message", "")}
    doc = {
        "id": raw["id"],
        "batch_id": raw["batch_id"],
        "handler": raw["handler"],
        "state": state,
        "stage": None if terminal else raw.get("stage"),
        "phase": raw.get("phase"),
        "node": raw.get("node") or None,
        "instance_index": int(raw.get("instance_index", 0)),
        "sample_index": int(raw.get("sample_index", 0)),
        "requeues": int(raw.get("requeues", 0)),
        "mode": raw.get("mode") or "policy",
        # Earlier attempts of a re-queued job: why each ended (the newest few).
        "attempts": json.loads(raw["attempts"]) if raw.get("attempts") else [],
        "created_at": _f(raw, "created_at"),
        "deadline_at": _f(raw, "deadline_at"),
        "finished_at": _f(raw, "finished_at"),
        "timings": stage_timings(raw),
        "failure": failure,
        # A failure is never a zero reward: reward stays null and the job is to be filtered.
        "reward": _f(raw, "reward") if state == JobState.DONE.value else None,
        "filtered": state != JobState.DONE.value,
        "result": with_payload(json.loads(raw["result"]), payloads)
        if raw.get("result") and terminal else None,
    }
    # The oldest policy version among the job's turns (None: no LLM turn).
    doc["policy_version"] = (doc["result"] or {}).get("policy_version")
    # Every field stated (SAMPLING_DEFAULTS filled in at submission): what sampled it.
    doc["sampling"] = json.loads(raw.get("sampling") or "{}")
    if include_instance:
        doc["instance"] = json.loads(raw.get("instance") or "null")
    return doc
