"""Trajectories as rows, to inspect or train on offline: ``prorl-farm export`` and
``FarmClient.export``. One row per job with every field of docs/trajectory.md, as JSONL,
Parquet, or an Arrow IPC file with the trajectory store's types (int32 ids, uint8 mask,
float32 logprobs or float64 where they are not float32 values: prorl_farm/columns.py)."""

from __future__ import annotations

import json

from prorl_farm.columns import ARRAYS, logprob_type

FORMATS = ("jsonl", "parquet", "arrow")

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
        **{name: _list(result.get(name)) for name in ARRAYS},
        "turns": result.get("turns") or [], "messages": result.get("messages") or [],
        "timings": job.get("timings") or {}, "eval": result.get("eval"),
        "stats": result.get("stats"),
    }


def _list(values) -> list:
    """An array of a result (a list from JSON, a numpy array from the Arrow stream)."""
    if values is None:
        return []
    return values.tolist() if hasattr(values, "tolist") else list(values)


def write_rows(jobs: list[dict], path: str, format: str = "jsonl") -> int:
    rows = [trajectory_row(j) for j in jobs]
    if format == "jsonl":
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    elif format in ("parquet", "arrow"):
        import numpy as np
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
        if format == "parquet":
            pq.write_table(pa.Table.from_pylist(flat, schema=schema), path)
        else:
            logprobs = np.fromiter((x for row in rows for x in row["response_logprobs"]),
                                   dtype=np.float64)
            kinds = dict(ARRAYS, response_logprobs=logprob_type(logprobs))
            schema = pa.schema([pa.field(f.name, pa.list_(kinds[f.name]))
                                if f.name in kinds else f for f in schema])
            table = pa.Table.from_pylist(flat, schema=schema)
            with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
                writer.write_table(table)
    else:
        raise ValueError(f"unknown export format {format!r}; expected one of {FORMATS}")
    return len(rows)
