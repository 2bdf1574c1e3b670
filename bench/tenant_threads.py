"""Two tenants on one API: A's calls alone, and beside B's flood of held connections.

  python bench/tenant_threads.py [--calls 200] [--record]

A private Redis, the API as `prorl-farm up` runs it (gunicorn, 2 workers x 16 threads), no
pools. Tenant A makes ``calls`` rounds of a submit (1 job) and a read of its batch, one
after another, and its latency per call is taken: alone, then while tenant B holds 200
long-polls on its own batch (``wait=100``) and 200 connections that sent half of their
headers or of their body. The baseline is A alone in the same run. The same scenario is run
against gunicorn's threaded worker (what served the API before), where a call that does not
finish within 20 s counts as a timeout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

import requests
from common import machine, pct, private_redis, report  # noqa: E402
from pipeline import Processes, farm_env, wait_for  # noqa: E402

from prorl_farm.cli import api_argv  # noqa: E402
from prorl_farm.config import load_settings  # noqa: E402
from prorl_farm.supervisor import free_port  # noqa: E402

KEY_A, KEY_B = "team-a-key-0123456789", "team-b-key-0123456789"
TENANTS = {"team-a": {"token": KEY_A}, "team-b": {"token": KEY_B}}
TIMEOUT_S = 20.0


def _up(base: str) -> bool:
    try:
        return requests.get(base + "/healthz", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def a_calls(base: str, calls: int) -> tuple[list[float], int]:
    """Seconds per call of A's (submit, then its batch's read), and the calls timed out."""
    session, out, timeouts = requests.Session(), [], 0
    auth = {"Authorization": f"Bearer {KEY_A}"}
    for _ in range(calls):
        t0 = time.perf_counter()
        try:
            sub = session.post(base + "/v1/jobs", headers=auth, timeout=TIMEOUT_S, json={
                "handler": "synthetic", "instances": [{"run_s": 0}]}).json()
            out.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            session.get(f"{base}/v1/batches/{sub['batch_id']}", headers=auth,
                        timeout=TIMEOUT_S).raise_for_status()
            out.append(time.perf_counter() - t0)
        except requests.Timeout:
            timeouts += 1
            if timeouts >= 3:
                break
    return out, timeouts


def flood(port: int, b_batch: str) -> list[socket.socket]:
    held = []
    for i in range(400):
        s = socket.create_connection(("127.0.0.1", port))
        if i % 2 == 0:
            s.sendall(f"GET /v1/batches/{b_batch}/results?wait=100 HTTP/1.1\r\nHost: x\r\n"
                      f"Authorization: Bearer {KEY_B}\r\n\r\n".encode())
        elif i % 4 == 1:
            s.sendall(f"GET /v1/batches HTTP/1.1\r\nAuthorization: Bearer {KEY_B}\r\n".encode())
        else:
            s.sendall(f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_B}"
                      f"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{"
                      .encode())
        held.append(s)
    return held


def scenario(url: str, argv: list[str], env: dict, log: Path, calls: int) -> dict:
    procs = Processes()
    port = int(argv[argv.index("--bind") + 1].rsplit(":", 1)[1])
    base = f"http://127.0.0.1:{port}"
    held: list[socket.socket] = []
    try:
        procs.start(argv, env, log)
        wait_for(lambda: _up(base), 30, "api")
        a_calls(base, 20)  # warm: connections, scripts
        alone, _ = a_calls(base, calls)
        b_batch = requests.post(base + "/v1/jobs", timeout=30, headers={
            "Authorization": f"Bearer {KEY_B}"}, json={
            "handler": "synthetic", "instances": [{"run_s": 0}]}).json()["batch_id"]
        held = flood(port, b_batch)
        time.sleep(1.0)
        beside, timeouts = a_calls(base, calls)
        return {"alone": alone, "beside": beside, "timeouts": timeouts}
    finally:
        for s in held:
            s.close()
        procs.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200, help="A's rounds per phase")
    ap.add_argument("--record", action="store_true", help="append to bench/RESULTS.md")
    args = ap.parse_args()
    rows = {}
    with private_redis() as url, tempfile.TemporaryDirectory() as d:
        env = {**farm_env(url, {}, events=False), "PRORL_TENANTS": json.dumps(TENANTS),
               "PRORL_API_TOKEN": "operator-key-0123456789", "PRORL_MAX_WAIT_S": "120"}
        port = free_port()
        farm = api_argv(load_settings(env), "127.0.0.1", port)
        threaded = [sys.executable, "-m", "gunicorn", "--worker-class", "gthread",
                    "--workers", "2", "--threads", "16", "--bind", f"127.0.0.1:{port}",
                    "--no-control-socket", "api.wsgi:app"]
        for name, argv in (("event loop + threads (the farm's)", farm),
                           ("gunicorn gthread (before)", threaded)):
            rows[name] = scenario(url, argv, env, Path(d) / "api.log", args.calls)
            got = rows[name]
            print(name, f"alone p99 {pct(got['alone'], 99) * 1000:.1f} ms",
                  f"beside p99 {pct(got['beside'], 99) * 1000:.1f} ms" if got["beside"]
                  else "beside: none", f"timeouts {got['timeouts']}", flush=True)
    lines = [f"\n## Two tenants' threads ({datetime.date.today()}, {machine()})\n",
             f"Tenant A's calls (a submit of 1 job, a read of its batch; {args.calls} rounds) "
             "on the API (2 workers x 16 threads), alone and beside tenant B's 200 long-polls "
             "on its own batch and 200 connections that sent half their headers or body. "
             f"A call not answered within {TIMEOUT_S:.0f} s is a timeout (3 end the phase).\n",
             "| server | A alone p50 / p99 (ms) | A beside B p50 / p99 (ms) | p99 beside / "
             "alone | A's timeouts |", "|---|---|---|---|---|"]
    for name, got in rows.items():
        alone, beside = got["alone"], got["beside"]
        ratio = (f"{pct(beside, 99) / pct(alone, 99):.2f}x" if beside and not got["timeouts"]
                 else "-")
        lines.append(
            f"| {name} | {pct(alone, 50) * 1000:.1f} / {pct(alone, 99) * 1000:.1f} | "
            + (f"{pct(beside, 50) * 1000:.1f} / {pct(beside, 99) * 1000:.1f}" if beside
               else "-") + f" | {ratio} | {got['timeouts']} |")
    report(lines, args.record)


if __name__ == "__main__":
    main()
