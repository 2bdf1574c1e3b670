"""The trajectory's columnar format, on disk and on the wire (Arrow).

One trajectory is one row: its arrays as typed list columns (``prompt_ids`` and
``response_ids`` int32, ``response_mask`` uint8, ``response_logprobs`` float32, or float64
where a backend's values are not all float32-exact, so what comes back is bit-identical to
what the backend returned) and ``rest``, the other keys (turns, messages) as one JSON
string. The trajectory store keeps a file of one row per attempt (jobs/payloads.py); a
page of results on the wire (``application/vnd.apache.arrow.stream``) is one table with a
row per job and its document in ``job`` (:func:`page_bytes`, :func:`read_page`). The
trainer's SDK reads pages with this module alone.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa

ARROW_STREAM = "application/vnd.apache.arrow.stream"
# The arrays kept as typed columns, with their Arrow value types (logprobs: float32 or
# float64, per file).
ARRAYS = {"prompt_ids": pa.int32(), "response_ids": pa.int32(), "response_mask": pa.uint8(),
          "response_logprobs": pa.float32()}
# Kept in the payload's JSON column (large), not in Redis's summary.
REST = ("turns", "messages")
PAYLOAD_KEYS = tuple(ARRAYS) + REST
PAGE_META = "prorl.page"


def json_default(value):
    """``json.dumps(job, default=json_default)``: a job read from the Arrow stream (numpy
    arrays in its result) written as JSON, the arrays as lists."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def logprob_type(values: np.ndarray) -> pa.DataType:
    """float32 where every value survives the round trip through it, else float64."""
    narrow = values.astype(np.float32)
    same = np.array_equal(narrow.astype(np.float64), values, equal_nan=True)
    return pa.float32() if same else pa.float64()


def payload_table(payload: dict) -> pa.Table:
    """One row: the trajectory's arrays as typed list columns and the rest as JSON."""
    columns, fields = [], []
    for name, kind in ARRAYS.items():
        values = np.asarray(payload.get(name, ()), dtype=np.float64 if name ==
                            "response_logprobs" else np.int64)
        if name == "response_logprobs":
            kind = logprob_type(values)
        elif values.size and (values.min() < np.iinfo(kind.to_pandas_dtype()).min
                              or values.max() > np.iinfo(kind.to_pandas_dtype()).max):
            raise ValueError(f"{name}: values outside {kind}")
        columns.append(pa.array([values.astype(kind.to_pandas_dtype())],
                                type=pa.list_(kind)))
        fields.append(pa.field(name, pa.list_(kind)))
    rest = {k: v for k, v in payload.items() if k not in ARRAYS}
    columns.append(pa.array([json.dumps(rest)], type=pa.large_string()))
    fields.append(pa.field("rest", pa.large_string()))
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def _list_values(column: pa.ChunkedArray, row: int) -> np.ndarray:
    cell = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    return cell[row].values.to_numpy(zero_copy_only=False)


def table_payload(table: pa.Table, row: int = 0, as_lists: bool = False) -> dict:
    """The payload of one row: numpy arrays (or lists), with the JSON part merged in."""
    out = json.loads(table.column("rest")[row].as_py() or "{}")
    for name in ARRAYS:
        values = _list_values(table.column(name), row)
        out[name] = values.tolist() if as_lists else values
    return out


# -- pages on the wire ---------------------------------------------------------------------


def page_bytes(docs: list[dict], tables: list[pa.Table | None], meta: dict) -> bytes:
    """A page of results as an Arrow stream: a row per job, ``job`` (the job's JSON, its
    result without payload) and the payload's columns (null for a job without one); ``meta``
    (the page's cursor and counts, as the JSON answer has them) in the schema's metadata
    under ``prorl.page``. Each stored row is written as it is (no copy into one table)."""
    wide = any(t is not None and t.schema.field("response_logprobs").type.value_type ==
               pa.float64() for t in tables)
    kinds = dict(ARRAYS, response_logprobs=pa.float64() if wide else pa.float32())
    row = pa.schema([pa.field(n, pa.list_(k)) for n, k in kinds.items()] +
                    [pa.field("rest", pa.large_string())])
    schema = pa.schema([pa.field("job", pa.large_string()), *row],
                       metadata={PAGE_META: json.dumps(meta)})
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, schema) as writer:
        for doc, table in zip(docs, tables):
            if table is None:
                columns = [pa.nulls(1, f.type) for f in row]
            else:
                if not table.schema.equals(row):
                    table = table.cast(row)
                columns = [table.column(i).chunk(0) if table.column(i).num_chunks == 1
                           else table.column(i).combine_chunks() for i in range(len(row))]
            job = pa.array([json.dumps(doc)], type=pa.large_string())
            writer.write_batch(pa.RecordBatch.from_arrays([job, *columns], schema=schema))
    return sink.getvalue()


def read_page(data) -> tuple[list[dict], dict]:
    """The jobs of a page (:func:`page_bytes`), each result's arrays as numpy arrays (views
    of ``data``, no copy), and the page's cursor and counts."""
    reader = pa.ipc.open_stream(pa.py_buffer(data))
    meta = json.loads((reader.schema.metadata or {}).get(PAGE_META.encode(), b"{}"))
    docs = []
    for batch in reader:
        names = batch.schema.names
        jobs = batch.column(names.index("job")).to_pylist()
        rest = batch.column(names.index("rest")).to_pylist()
        arrays = {}
        for name in ARRAYS:
            col = batch.column(names.index(name))
            values = col.values.to_numpy(zero_copy_only=False)
            offsets = col.offsets.to_numpy()
            valid = col.is_valid().to_numpy(zero_copy_only=False)
            arrays[name] = [values[offsets[i]:offsets[i + 1]] if valid[i] else None
                            for i in range(len(col))]
        for i, raw in enumerate(jobs):
            doc = json.loads(raw)
            docs.append(doc)
            if rest[i] is None or doc.get("result") is None:
                continue
            doc["result"].update(json.loads(rest[i]))
            for name in ARRAYS:
                doc["result"][name] = arrays[name][i]
    return docs, meta
