"""FarmClient: submit jobs, stream finished results, cancel, manage backends, export — over
the HTTP API v1.

Safe to retry: a lost connection or a 503 is retried with exponential backoff. Every
submit carries an idempotency key (one per call, made here unless given), so a submit
retried after its answer was lost returns the same batch instead of a second one; reads,
cancels, drain and resume are idempotent by nature; registering a backend is retried only
when the request could not have reached the farm.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import requests
import urllib3

from prorl_farm.columns import ARROW_STREAM, read_page
from prorl_farm.config import read
from prorl_farm.errors import FarmError
from prorl_farm.retry import with_retries


class FarmHTTPError(FarmError, RuntimeError):
    """The API answered with an error document (subclasses by status)."""

    def __init__(self, status: int, error: dict):
        super().__init__(f"{status} {error.get('code')}: {error.get('message')}")
        self.status = status
        self.code = error.get("code")
        self.details = error.get("details")


class FarmBadRequest(FarmHTTPError):
    """400: the request is invalid (``details`` names the fields)."""


class FarmUnauthorized(FarmHTTPError):
    """401/403: no or a wrong API token, or a request the farm's rules refuse (a backend
    URL outside its allow-list)."""


class FarmNotFound(FarmHTTPError):
    """404: no such job, batch or backend."""


class FarmConflict(FarmHTTPError):
    """409: an idempotency key reused with another body, a policy version going back."""


class FarmUnavailable(FarmHTTPError):
    """503 (after the retries): Redis, the broker or the pools are not there."""


class FarmOverQuota(FarmHTTPError):
    """429: the submit would pass its tenant's quota; nothing was enqueued. ``retry_after_s``:
    what the farm says to wait."""

    retry_after_s: float = 5.0


class FarmConnectionError(FarmError, ConnectionError):
    """The farm could not be reached (after the retries)."""


_BY_STATUS = {400: FarmBadRequest, 401: FarmUnauthorized, 403: FarmUnauthorized,
              404: FarmNotFound, 409: FarmConflict, 429: FarmOverQuota,
              503: FarmUnavailable}


def _error(status: int, resp: requests.Response) -> FarmHTTPError:
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        error = {"code": "http_error", "message": resp.text[:500]}
    if not isinstance(error, dict):  # a probe's body: {"ready": false, "error": "..."}
        error = {"code": "http_error", "message": str(error)[:500]}
    out = _BY_STATUS.get(status, FarmHTTPError)(status, error)
    if isinstance(out, FarmOverQuota):
        try:
            out.retry_after_s = max(0.1, float(resp.headers.get("Retry-After", "")))
        except ValueError:
            pass
    return out


class FarmClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", timeout_s: float = 30.0,
                 retries: int = 5, backoff_s: float = 0.5, max_backoff_s: float = 8.0,
                 token: str | None = None, quota_wait_s: float = 3600.0,
                 tenant: str | None = None):
        """``token``: the farm's API token or a tenant's key (default: ``PRORL_API_TOKEN``
        from the environment), sent as ``Authorization: Bearer``. ``quota_wait_s``: how long
        a submit over its tenant's quota (429) keeps waiting for room, as the farm's
        Retry-After says, before it raises FarmOverQuota. ``tenant``: the tenant every
        submit is for (default: the key's own)."""
        self.base_url = base_url.rstrip("/")
        self.quota_wait_s = quota_wait_s
        self.tenant = tenant
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.http = requests.Session()
        token = read("api_token") if token is None else token
        if token:
            self.http.headers["Authorization"] = f"Bearer {token}"

    def _call(self, method: str, path: str, timeout_s: float | None = None,
              retry: str = "all", binary: bool = False, **kw):
        """One API call. ``retry``: ``all`` (connection errors and 503), ``connect`` (only
        where the request cannot have been received), ``none``. ``binary``: ask for the
        Arrow stream and return the page it holds (jobs, page meta)."""
        if binary:
            kw["headers"] = {**kw.get("headers", {}), "Accept": ARROW_STREAM}
        where = f"{method} {self.base_url}{path}"

        def lost(e: Exception, retry_ok: bool) -> FarmConnectionError:
            out = FarmConnectionError(f"{where}: {e}")
            out.retry_ok = retry_ok
            return out

        def once():
            try:
                resp = self.http.request(method, self.base_url + path,
                                         timeout=timeout_s or self.timeout_s,
                                         stream=binary, **kw)
            except requests.ConnectionError as e:
                received = not isinstance(e, requests.ConnectTimeout) and \
                    "NewConnectionError" not in repr(e)
                raise lost(e, retry == "all" or not received) from e
            except (requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
                # no answer in time; the answer cut short
                raise lost(e, retry == "all") from e
            if resp.status_code >= 400:
                with resp:
                    error = _error(resp.status_code, resp)
                    # The request was not taken: the farm is not there (503), or this
                    # key's share of the API's threads is in use (429 too_many_requests).
                    error.retry_ok = resp.status_code == 503 or \
                        error.code == "too_many_requests"
                    raise error
            if not binary:
                return resp.json()
            # One read of the whole body (requests' .content reads 10 KB at a time).
            with resp:
                try:
                    body = resp.raw.read(decode_content=True)
                except (urllib3.exceptions.HTTPError, OSError) as e:
                    # the API went away mid-answer (a restart): asked again
                    raise lost(e, retry == "all") from e
            return read_page(body)

        return with_retries(once, 0 if retry == "none" else self.retries, self.backoff_s,
                            self.max_backoff_s,
                            retryable=lambda e: getattr(e, "retry_ok", False))

    # -- jobs and batches -----------------------------------------------------------------

    def submit(self, handler: str, instances: list[dict], n: int = 1,
               sampling: dict | None = None, deadline_s: float | None = None,
               batch_id: str | None = None, mode: str = "policy",
               idempotency_key: str | None = None, priority: int = 0) -> dict:
        """Submit instances x n jobs; returns {batch_id, job_ids} (and ``replayed`` when
        the farm had this submit already). ``mode="reference"`` grades each instance's own
        reference instead of a policy's answer. ``priority`` (-100 to 100): the jobs' order
        within the tenant's share (an evaluation before training, a replenishment before a
        new step)."""
        body = {"handler": handler, "instances": instances, "n": n,
                "sampling": sampling or {}, "deadline_s": deadline_s, "mode": mode,
                "idempotency_key": idempotency_key or uuid.uuid4().hex}
        if batch_id:
            body["batch_id"] = batch_id
        if priority:
            body["priority"] = priority
        if self.tenant:
            body["tenant"] = self.tenant
        give_up = time.monotonic() + self.quota_wait_s
        while True:
            try:
                answer = self._call("POST", "/v1/jobs", json=body)
                for said in (answer.get("warnings") or {}).get("instances", []):
                    print(f"prorl-farm: {said['count']} instance(s) (indexes "
                          f"{', '.join(map(str, said['indexes'][:5]))}"
                          f"{', ...' if said['count'] > 5 else ''}): "
                          f"{'; '.join(said['warnings'])}", file=sys.stderr, flush=True)
                return answer
            except FarmOverQuota as e:  # nothing was enqueued: the same submit again
                if time.monotonic() + e.retry_after_s > give_up:
                    raise
                print(f"prorl-farm: submit refused ({e}); trying again in "
                      f"{e.retry_after_s:g} s", file=sys.stderr, flush=True)
                time.sleep(e.retry_after_s)

    def grade_swebench(self, predictions: dict[str, dict] | str, dataset: list[dict] | str,
                       run_id: str | None = None, report_dir: str = ".",
                       deadline_s: float = 3600.0, progress: bool | None = None) -> dict:
        """Grade a SWE-bench predictions file (or ``{instance_id: prediction}``) on its
        ``dataset`` rows (or their file) through the farm; write swebench's run report and
        instance reports under ``report_dir``; returns ``{"report", "path", "instances"}``
        (``prorl_farm/trainer/swebench.py``)."""
        from prorl_farm.trainer import swebench as grading

        if isinstance(predictions, str):
            predictions = grading.read_predictions(predictions)
        if isinstance(dataset, str):
            dataset = grading.read_json_rows(dataset)
        return grading.grade(self, predictions, dataset, run_id or grading.default_run_id(),
                             report_dir, deadline_s, progress)

    def job(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def batch(self, batch_id: str) -> dict:
        return self._call("GET", f"/v1/batches/{batch_id}")

    def batches(self, limit: int = 50) -> list[dict]:
        return self._call("GET", "/v1/batches", params={"limit": limit})["batches"]

    def cancel_batch(self, batch_id: str) -> dict:
        return self._call("POST", f"/v1/batches/{batch_id}/cancel")

    def results(self, batch_id: str, cursor: str = "0-0", limit: int = 100,
                wait_s: float = 0.0, binary: bool = True) -> dict:
        """A page of the batch's finished jobs: {results, cursor, complete, finished,
        total}. ``binary`` (the default): fetched as an Arrow stream, each trajectory's
        arrays as numpy arrays (int32 ids, uint8 mask, float32/float64 logprobs); else as
        JSON, with lists."""
        params = {"cursor": cursor, "limit": limit, "wait": wait_s}
        timeout_s = self.timeout_s + wait_s
        if not binary:
            return self._call("GET", f"/v1/batches/{batch_id}/results", params=params,
                              timeout_s=timeout_s)
        jobs, meta = self._call("GET", f"/v1/batches/{batch_id}/results", params=params,
                                timeout_s=timeout_s, binary=True)
        return {"results": jobs, **meta}

    def ack(self, batch_id: str) -> dict:
        """The batch is consumed: the farm deletes its trajectories' payloads (summaries
        stay until the result TTL). The batch must be complete (cancel what is left)."""
        return self._call("POST", f"/v1/batches/{batch_id}/ack")

    def results_many(self, cursors: dict[str, str], limit: int = 100, wait_s: float = 0.0,
                     binary: bool = True) -> dict[str, dict]:
        """New results of several batches in one request ({batch id: cursor}, at most
        1,000): {batch id: {results, cursor, complete, finished, total, found}}; long-polls
        up to ``wait_s`` while none of the incomplete ones has a result. ``binary``: as in
        :meth:`results`."""
        body = {"cursors": cursors, "limit": limit, "wait": wait_s}
        if not binary:
            return self._call("POST", "/v1/batches/results", json=body,
                              timeout_s=self.timeout_s + wait_s)["batches"]
        jobs, meta = self._call("POST", "/v1/batches/results", json=body,
                                timeout_s=self.timeout_s + wait_s, binary=True)
        out = {b: ({**m, "results": []} if m.get("found") else m)
               for b, m in meta["batches"].items()}
        for job in jobs:  # a job names its batch as stored: "<tenant>:<id>" (docs/api.md)
            stored = job["batch_id"]
            out[stored if stored in out else stored.partition(":")[2]]["results"].append(job)
        return out

    def iter_results(self, batch_id: str, expected: int | None = None, wait_s: float = 10.0,
                     timeout_s: float | None = None, cursor: str = "0-0",
                     progress: bool | None = False, page_size: int = 256,
                     binary: bool = True) -> Iterator[dict]:
        """Yield finished jobs in the order they finished, until ``expected`` are seen (by
        default, the batch's total), long-polling the batch's stream: one request per page
        or per ``wait_s`` of quiet, never a busy loop; the next page is fetched and decoded
        while the caller works through this one. ``progress``: a tqdm bar on stderr (None:
        when stderr is a terminal). ``binary``: as in :meth:`results`."""
        expected = self.batch(batch_id)["total"] if expected is None else expected
        seen = 0
        end = None if timeout_s is None else time.monotonic() + timeout_s
        bar = None
        if progress or (progress is None and sys.stderr.isatty()):
            from tqdm import tqdm

            bar = tqdm(total=expected, unit="job", desc=batch_id[:12], file=sys.stderr)
        ahead = ThreadPoolExecutor(1, thread_name_prefix="prorl-results")
        nxt = None
        try:
            while seen < expected:
                if end is not None and time.monotonic() > end:
                    raise TimeoutError(f"{seen}/{expected} results after {timeout_s} s")
                wait = wait_s if end is None else max(0.0, min(wait_s,
                                                               end - time.monotonic()))
                page = nxt.result() if nxt is not None else \
                    self.results(batch_id, cursor, page_size, wait, binary)
                nxt = None
                cursor = page["cursor"]
                if page["results"] and seen + len(page["results"]) < expected:
                    nxt = ahead.submit(self.results, batch_id, cursor, page_size, wait, binary)
                for job in page["results"]:
                    seen += 1
                    if bar is not None:
                        bar.update(1)
                    yield job
        finally:
            # A page fetched ahead and not wanted (the caller stopped early) is dropped.
            ahead.shutdown(wait=False, cancel_futures=True)
            if bar is not None:
                bar.close()

    def export(self, batch_id: str, path: str, format: str = "jsonl") -> int:
        """Write every finished job of the batch to ``path``, one row per trajectory with
        every field of docs/trajectory.md (``jsonl``, ``parquet``, or ``arrow``: an Arrow IPC
        file with the trajectory store's types); returns the rows."""
        from prorl_farm.trainer.export import write_rows

        total = self.batch(batch_id)["finished"]
        rows = list(self.iter_results(batch_id, expected=total, wait_s=0.0))
        return write_rows(rows, path, format)

    # -- LLM backends ---------------------------------------------------------------------

    def register_backend(self, url: str, kind: str, model: str, tokenizer: str,
                         capacity: int = 1, policy_version: int = 0,
                         logprobs_mode: str = "", tenant: str | None = None) -> dict:
        """Register an LLM backend: only the jobs of its tenant (``tenant``, default the
        key's own) are sent to it."""
        body = {"url": url, "kind": kind, "model": model, "tokenizer": tokenizer,
                "capacity": capacity, "policy_version": policy_version,
                "logprobs_mode": logprobs_mode}
        if tenant:
            body["tenant"] = tenant
        return self._call("POST", "/v1/backends", retry="connect", json=body)

    def tenants(self) -> dict:
        """Each tenant's weight, quotas and usage now: {tenants, you, operator}."""
        return self._call("GET", "/v1/tenants")

    def backends(self) -> list[dict]:
        return self._call("GET", "/v1/backends")["backends"]

    def backend(self, backend_id: str) -> dict:
        return self._call("GET", f"/v1/backends/{backend_id}")

    def unregister_backend(self, backend_id: str) -> dict:
        try:
            return self._call("DELETE", f"/v1/backends/{backend_id}")
        except FarmNotFound:
            return {"id": backend_id, "unregistered": True}  # a retry after it went

    def drain_backend(self, backend_id: str) -> dict:
        return self._call("POST", f"/v1/backends/{backend_id}/drain")

    def wait_drained(self, backend_id: str, timeout_s: float = 600.0,
                     poll_s: float = 0.2) -> dict:
        """Wait until a drained backend has no job in flight (before a weight sync)."""
        end = time.monotonic() + timeout_s
        while True:
            info = self.backend(backend_id)
            if info["in_flight"] == 0:
                return info
            if time.monotonic() > end:
                raise TimeoutError(f"backend {backend_id} still has {info['in_flight']} jobs "
                                   f"in flight after {timeout_s} s")
            time.sleep(poll_s)

    def resume_backend(self, backend_id: str, policy_version: int) -> dict:
        return self._call("POST", f"/v1/backends/{backend_id}/resume",
                          json={"policy_version": policy_version})

    def sync_weights(self, path: str, policy_version: int, backend_id: str | None = None,
                     probe: dict | None = None, tolerance: float | None = None,
                     verify: bool = True, drain_timeout_s: float = 600.0,
                     model: str | None = None, mode: str = "drain") -> dict:
        """Load the checkpoint at ``path`` into one backend (or every backend, or those of
        ``model``) the engine's way and resume it at ``policy_version`` once the farm has
        checked that it computes what the checkpoint computes. ``probe``: ``{"token_ids":
        [...], "logprobs": [...]}`` from the trainer's own model (one logprob per token
        after the first); without it the farm computes one from ``path``. A backend that
        fails the check stays out of service: :class:`FarmConflict` ``weights_mismatch``.
        ``mode``: ``drain`` (every job pinned to a backend finishes first: strictly
        on-policy) or ``in_place`` (generation pauses, the turns in flight go on under the
        new weights from the tokens they have, each token labelled with its version).
        Returns the backend's record (one backend) or ``{"backends": [...]}``."""
        body = {"path": str(path), "policy_version": policy_version, "verify": verify,
                "drain_timeout_s": drain_timeout_s, "mode": mode}
        body.update({k: v for k, v in (("probe", probe), ("tolerance", tolerance),
                                       ("model", model)) if v is not None})
        timeout_s = drain_timeout_s + 900.0  # the drain, the load and the check
        if backend_id:
            return self._call("POST", f"/v1/backends/{backend_id}/weights", timeout_s=timeout_s,
                              retry="connect", json=body)
        return self._call("POST", "/v1/weights", timeout_s=timeout_s, retry="connect",
                          json=body)

    def history(self, window_s: float = 3600.0) -> dict:
        """The farm a minute at a time over the last ``window_s`` seconds (kept a day): jobs
        ended by state, failures by kind, mean reward and pass rate, stage waits, backend
        load and latency (``GET /v1/history``; prorl_farm/history.py)."""
        return self._call("GET", "/v1/history", params={"window_s": window_s})

    def overview(self) -> dict:
        """Queues, stages, pools, backends, sandboxes and jobs by state (what the dashboard
        draws)."""
        return self._call("GET", "/v1/overview")

    def handlers(self) -> list[dict]:
        return self._call("GET", "/v1/handlers")["handlers"]

    def ready(self) -> bool:
        try:
            self._call("GET", "/readyz", timeout_s=5, retry="none")
            return True
        except (FarmHTTPError, FarmConnectionError):
            return False
