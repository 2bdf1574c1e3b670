"""Trajectories as rows, to inspect or train on offline: ``prorl-farm export`` and
``FarmClient.export``. One row per job with every field of docs/trajectory.md."""

from __future__ import annotations

import json

# Fields whose shape varies by handler: JSON text in Parquet (native in JSONL).
JSON_COLUMNS = ("failure", "sampling", "turns", "messages", "timings", "eval", "stats")


def trajectory_row(job: dict) -> dict:
    """A job document (GET /v1/jobs/<id> or a results page) as one flat row."""
    result = job.get("result") or {}
    return {
        "job_id": job["id"], "batch_id": job["batch_id"], "handler": job["handler"],
        "instance_index": job["instance_index"], "sample_index": job["sample_index"],
        "state": job["state"], "reward": job["reward"], "filtered": job["filtered"],
        "failure": job.get("failure"), "policy_version": job.get("policy_version"),
        "sampling": job.get("sampling") or {},
        "prompt_ids": result.get("prompt_ids") or [],
        "response_ids": result.get("response_ids") or [],
        "response_mask": result.get("response_mask") or [],
        "response_logprobs": result.get("response_logprobs") or [],
        "turns": result.get("turns") or [], "messages": result.get("messages") or [],
        "timings": job.get("timings") or {}, "eval": result.get("eval"),
        "stats": result.get("stats"),
    }


def write_rows(jobs: list[dict], path: str, format: str = "jsonl") -> int:
    rows = [trajectory_row(j) for j in jobs]
    if format == "jsonl":
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    elif format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        flat = [{k: json.dumps(v) if k in JSON_COLUMNS else v for k, v in row.items()}
                for row in rows]
        schema = pa.schema([
            ("job_id", pa.string()), ("batch_id", pa.string()), ("handler", pa.string()),
            ("instance_index", pa.int64()), ("sample_index", pa.int64()),
            ("state", pa.string()), ("reward", pa.float64()), ("filtered", pa.bool_()),
            ("failure", pa.string()), ("policy_version", pa.int64()),
            ("prompt_ids", pa.list_(pa.int64())), ("response_ids", pa.list_(pa.int64())),
            ("response_mask", pa.list_(pa.int8())),
            ("response_logprobs", pa.list_(pa.float64())),
            *[(c, pa.string()) for c in ("turns", "messages", "timings", "eval", "stats")]])
        pq.write_table(pa.Table.from_pylist(flat, schema=schema), path)
    else:
        raise ValueError(f"unknown export format {format!r}; expected jsonl or parquet")
    return len(rows)
