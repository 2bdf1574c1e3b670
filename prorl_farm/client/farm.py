"""FarmClient: submit jobs, stream finished results, cancel — over the HTTP API v1."""

from __future__ import annotations

import time
from collections.abc import Iterator

import requests

from prorl_farm.errors import FarmError


class FarmHTTPError(FarmError, RuntimeError):
    """The API answered with an error document."""

    def __init__(self, status: int, error: dict):
        super().__init__(f"{status} {error.get('code')}: {error.get('message')}")
        self.status = status
        self.code = error.get("code")
        self.details = error.get("details")


class FarmClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", timeout_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.http = requests.Session()

    def _call(self, method: str, path: str, timeout_s: float | None = None, **kw) -> dict:
        resp = self.http.request(method, self.base_url + path,
                                 timeout=timeout_s or self.timeout_s, **kw)
        if resp.status_code >= 400:
            try:
                error = resp.json()["error"]
            except (ValueError, KeyError):
                error = {"code": "http_error", "message": resp.text[:500]}
            raise FarmHTTPError(resp.status_code, error)
        return resp.json()

    def submit(self, handler: str, instances: list[dict], n: int = 1,
               sampling: dict | None = None, deadline_s: float | None = None,
               batch_id: str | None = None, mode: str = "policy") -> dict:
        """Submit instances x n jobs; returns {batch_id, job_ids}. ``mode="reference"``
        grades each instance's own reference instead of a policy's answer."""
        body = {"handler": handler, "instances": instances, "n": n,
                "sampling": sampling or {}, "deadline_s": deadline_s, "mode": mode}
        if batch_id:
            body["batch_id"] = batch_id
        return self._call("POST", "/v1/jobs", json=body)

    def job(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def batch(self, batch_id: str) -> dict:
        return self._call("GET", f"/v1/batches/{batch_id}")

    def cancel_batch(self, batch_id: str) -> dict:
        return self._call("POST", f"/v1/batches/{batch_id}/cancel")

    def results(self, batch_id: str, cursor: str = "0-0", limit: int = 100,
                wait_s: float = 0.0) -> dict:
        return self._call("GET", f"/v1/batches/{batch_id}/results",
                          params={"cursor": cursor, "limit": limit, "wait": wait_s},
                          timeout_s=self.timeout_s + wait_s)

    def iter_results(self, batch_id: str, expected: int | None = None, wait_s: float = 10.0,
                     timeout_s: float | None = None) -> Iterator[dict]:
        """Yield finished jobs in the order they finished, until ``expected`` are seen."""
        expected = self.batch(batch_id)["total"] if expected is None else expected
        cursor, seen = "0-0", 0
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while seen < expected:
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"{seen}/{expected} results after {timeout_s} s")
            page = self.results(batch_id, cursor, limit=1000, wait_s=wait_s)
            cursor = page["cursor"]
            for job in page["results"]:
                seen += 1
                yield job

    # -- LLM backends ---------------------------------------------------------------------

    def register_backend(self, url: str, kind: str, model: str, tokenizer: str,
                         capacity: int = 1, policy_version: int = 0,
                         logprobs_mode: str = "") -> dict:
        return self._call("POST", "/v1/backends", json={
            "url": url, "kind": kind, "model": model, "tokenizer": tokenizer,
            "capacity": capacity, "policy_version": policy_version,
            "logprobs_mode": logprobs_mode})

    def backends(self) -> list[dict]:
        return self._call("GET", "/v1/backends")["backends"]

    def unregister_backend(self, backend_id: str) -> dict:
        return self._call("DELETE", f"/v1/backends/{backend_id}")

    def drain_backend(self, backend_id: str) -> dict:
        return self._call("POST", f"/v1/backends/{backend_id}/drain")

    def resume_backend(self, backend_id: str, policy_version: int) -> dict:
        return self._call("POST", f"/v1/backends/{backend_id}/resume",
                          json={"policy_version": policy_version})

    def handlers(self) -> list[dict]:
        return self._call("GET", "/v1/handlers")["handlers"]

    def ready(self) -> bool:
        try:
            self._call("GET", "/readyz", timeout_s=5)
            return True
        except (FarmHTTPError, requests.ConnectionError):
            return False
