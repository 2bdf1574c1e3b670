"""Property-based runs against /openapi.json (schemathesis strategies, hypothesis).

For every operation, requests the spec calls valid are generated and sent to the app: none
may be rejected (a 4xx other than 404 for an id that names nothing, 409, or 422 from a
backend probe) and none may fail (5xx). So the spec states every constraint the API
enforces, and valid input never reaches an unhandled error. No worker runs here: submitted
jobs just wait in Redis, which the ``r`` fixture clears.
"""

from __future__ import annotations

import hypothesis
import pytest
import schemathesis
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode

pytestmark = pytest.mark.slow

# Statuses a valid request may still get: 404 (a generated id names nothing), 409 (an
# idempotency key drawn twice with another body; a lower policy version), 422 (an
# unreachable backend under ?probe=strict), 403 (a backend URL outside the allow-list),
# 202/201/200 (accepted).
ALLOWED_4XX = {403, 404, 409, 422}


def _valid_body(case, body) -> bool:
    """Whether the drawn body is valid per the spec's own schema of it (a JSON Schema
    validator's verdict). Schemathesis mixes the spec's constants into other fields of a
    positive case and does not keep every anyOf/not across fields, so some of its
    "positive" bodies are not: they prove nothing about the API."""
    if body is None:
        return True
    for alternative in case.operation.body:
        if alternative.media_type == case.media_type:
            return alternative.is_valid(body)
    return True


def _fuzz(app, r, mode: GenerationMode, judge) -> list[str]:
    """Send 300 requests of ``mode`` drawn from every operation of the spec to the app;
    returns the problems ``judge(case, response)`` names (None: fine). In POSITIVE mode, a
    body the spec's schema does not take is left out; most must be taken."""
    schema = schemathesis.openapi.from_wsgi("/openapi.json", app)
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) >= 15
    client = app.test_client()
    problems: list[str] = []
    drawn = {"bodies": 0, "left out": 0}

    @hypothesis.settings(max_examples=300, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(data=st.data())
    def run(data):
        op = data.draw(st.sampled_from(operations))
        case = data.draw(op.as_strategy(mode))
        body = case.body if not isinstance(case.body, type(schemathesis.core.NOT_SET)) else None
        payload = ({"data": body, "content_type": "application/json"}
                   if isinstance(body, (bytes, str)) else {"json": body})
        if mode is GenerationMode.POSITIVE and body is not None:
            drawn["bodies"] += 1
            if not _valid_body(case, body):
                drawn["left out"] += 1
                return
        response = client.open(case.formatted_path, method=case.method.upper(),
                               query_string=case.query, **payload)
        problem = judge(case, response)
        if problem:
            problems.append(f"{case.method} {case.formatted_path} query={case.query} "
                            f"body={str(body)[:200]} -> {response.status_code} "
                            f"{response.get_data(as_text=True)[:300]} ({problem})")

    try:
        run()
    finally:
        r.delete("init")  # the messages of the jobs submitted here: no worker will take them
    assert drawn["left out"] <= drawn["bodies"] / 2, drawn
    return problems


def test_valid_per_spec_is_never_rejected(app, r):
    def judge(case, response):
        status = response.status_code
        if case.formatted_path == "/readyz" and status == 503:
            return None  # declared: no pool runs in this test
        if status == 400 and response.get_json()["error"]["code"] in (
                "too_many_jobs", "insufficient_context"):
            # Over the operator's limit; a context smaller than a harness preset needs:
            # both stated in the spec, neither a shape a schema can say.
            return None
        if status >= 500 or (400 <= status < 500 and status not in ALLOWED_4XX):
            return "valid per the spec but rejected"
        return None

    rejected = _fuzz(app, r, GenerationMode.POSITIVE, judge)
    assert not rejected, "\n".join(rejected[:10])


def test_invalid_per_spec_gets_a_4xx_never_a_5xx(app, r):
    """Requests the spec calls invalid (wrong types, out-of-range values, unknown fields,
    bad cursors...) are refused with a 4xx and an error document, never a 5xx."""
    def judge(case, response):
        if response.status_code >= 500:
            return "server error"
        if response.status_code >= 400 and response.status_code != 405 and \
                "error" not in (response.get_json(silent=True) or {}):
            return "no error document"
        return None

    failures = _fuzz(app, r, GenerationMode.NEGATIVE, judge)
    assert not failures, "\n".join(failures[:10])
