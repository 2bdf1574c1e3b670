"""/healthz (process up), /readyz (Redis and a live pool for every stage), /metrics."""

from __future__ import annotations

from flask import Blueprint, Response

from api.services import services
from prorl_farm import keys
from prorl_farm.config import STAGES
from prorl_farm.jobs.states import ALL_STATES

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz():
    return {"ok": True}


@bp.get("/readyz")
def readyz():
    svc = services()
    try:
        svc.store.r.ping()
        pools = svc.store.live_pools(svc.settings.heartbeat_stale_s)
    except Exception as e:
        return {"ready": False, "redis": False, "error": str(e)}, 503
    missing = [s for s in STAGES if not any(p.startswith(f"{s}:") for p in pools)]
    body = {"ready": not missing, "redis": True, "pools": pools, "missing_stages": missing}
    return body, 200 if not missing else 503


@bp.get("/metrics")
def metrics():
    """Prometheus text format."""
    r = services().store.r
    stats = r.hgetall(keys.STATS)
    queues = sorted(r.smembers(keys.QUEUES))
    pipe = r.pipeline(transaction=False)
    for q in queues:
        pipe.zcard(keys.queued(q))
    pipe.zcard(keys.ACTIVE)
    *waiting, active = pipe.execute()
    lines = ["# HELP prorl_jobs_finished_total Jobs that reached a terminal state.",
             "# TYPE prorl_jobs_finished_total counter"]
    for state in ALL_STATES[-3:]:
        lines.append(f'prorl_jobs_finished_total{{state="{state}"}} {int(stats.get(state, 0))}')
    lines += ["# HELP prorl_jobs_waiting Jobs waiting on a queue.",
              "# TYPE prorl_jobs_waiting gauge"]
    lines += [f'prorl_jobs_waiting{{queue="{q}"}} {n}' for q, n in zip(queues, waiting)]
    lines += ["# HELP prorl_jobs_held Jobs held (reserved or running) by a live worker.",
              "# TYPE prorl_jobs_held gauge", f"prorl_jobs_held {active}"]
    return Response("\n".join(lines) + "\n", mimetype="text/plain; version=0.0.4")
