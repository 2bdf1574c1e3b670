"""Worker pool processes: `prorl-farm worker init|run|eval`.

Each pool is one Celery worker process consuming one queue with its own pool type and
concurrency, importing only its own stage's task module (``workers/<stage>/tasks.py``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from celery import Celery
from celery.signals import worker_process_init, worker_ready, worker_shutting_down

from prorl_farm.celery_app import TASK_NAMES, create_celery_app, queue_for
from prorl_farm.config import STAGES, Settings, load_settings
from prorl_farm.handlers.registry import HandlerRegistry
from prorl_farm.jobs.liveness import Liveness, Reaper
from prorl_farm.jobs.runner import StageRunner
from prorl_farm.jobs.store import JobStore
from prorl_farm.llm.registry import BackendRegistry

log = logging.getLogger(__name__)


class WorkerFarm:
    """Everything one pool process shares between its task threads."""

    def __init__(self, app: Celery, settings: Settings, stage: str, main_process: bool):
        self.app = app
        self.settings = settings
        self.stage = stage
        # One connection per pool thread at most, plus the liveness and probe threads.
        self.store = JobStore.from_settings(settings, settings.pool(stage).concurrency + 8)
        reaper = (Reaper(self.store, settings, self.requeue,
                         BackendRegistry(self.store.r)) if main_process else None)
        self.liveness = Liveness(self.store, settings, stage,
                                 reserved=_reserved_requests if main_process else None,
                                 reaper=reaper)
        worker_name = f"{socket.gethostname()}:{os.getpid()}"
        self.backends = BackendRegistry(self.store.r, audit=settings.backend_audit)
        self.sandboxes = _sandbox_manager(self.store.r, settings)
        if main_process and self.sandboxes is not None:
            self.liveness.janitor = self.sandboxes.janitor
        self.runner = StageRunner(settings, self.store, HandlerRegistry(settings.handlers),
                                  self.liveness, self.publish, worker_name, self.backends,
                                  self.sandboxes)

    def publish(self, stage: str, job_id: str, token: str, queue: str) -> None:
        # The token doubles as the Celery task id, so the API can revoke it by job state.
        self.app.send_task(TASK_NAMES[stage], args=[job_id, token], queue=queue, task_id=token)

    def requeue(self, job_id: str, token: str) -> None:
        self.publish("init", job_id, token, "init")


def _sandbox_manager(r, settings: Settings):
    """This node's SandboxManager, or None (logged) if its runtime cannot run here."""
    from prorl_farm.sandbox.manager import SandboxManager

    try:
        return SandboxManager(r, settings.node, settings.sandbox_runtime, settings.sandbox_dir,
                              settings.sandbox_max)
    except Exception:
        log.exception("sandboxes are unavailable on this node")
        return None


def _reserved_requests():
    """(job, token) of every message this worker holds: reserved, running or prefetched."""
    from celery.worker import state

    for _ in range(5):
        try:
            requests = list(state.reserved_requests)
            break
        except RuntimeError:  # the consumer thread changed the set while we copied it
            continue
    else:
        requests = []
    return [(str(rq.args[0]), str(rq.id)) for rq in requests if len(rq.args or ()) == 2]


_farm: WorkerFarm | None = None
_farm_lock = threading.Lock()
_app: Celery | None = None
_stage: str = ""
_main_pid: int = 0


def get_farm(stage: str = "") -> WorkerFarm:
    """This process's WorkerFarm, built on first use (the pool's main process, which also
    reaps and heartbeats prefetched messages, or a prefork child). Also works in a worker
    started with plain ``celery worker`` rather than ``prorl-farm worker``."""
    global _farm
    if _farm is None:
        with _farm_lock:
            if _farm is None:
                from celery import current_app

                farm = WorkerFarm(_app or current_app, load_settings(), _stage or stage,
                                  main_process=os.getpid() == _main_pid)
                farm.liveness.start()
                _farm = farm
    return _farm


@worker_ready.connect
def _on_ready(**_):
    farm = get_farm()
    log.info("%s pool ready on node %s", _stage, farm.settings.node)


@worker_process_init.connect
def _on_child(**_):
    global _farm
    _farm = None  # forked from the main process: build our own clients and thread


@worker_shutting_down.connect
def _on_shutdown(**_):
    if _farm is not None:
        _farm.liveness.stop()


def worker_main(stage: str, extra_argv: list[str] | None = None) -> None:
    """Run the pool for ``stage`` in the foreground until SIGTERM."""
    global _app, _stage, _main_pid
    if stage not in STAGES:
        raise SystemExit(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")
    settings = load_settings()
    if not settings.redis_url:
        raise SystemExit("PRORL_REDIS_URL must be set for a worker pool")
    pool = settings.pool(stage)
    _stage = stage
    _main_pid = os.getpid()
    _app = create_celery_app(settings, include=[f"workers.{stage}.tasks"])
    _app.conf.worker_prefetch_multiplier = pool.prefetch_multiplier
    argv = [
        "worker", "-Q", queue_for(stage, settings.node), "-P", pool.pool,
        "-c", str(pool.concurrency), "-n", f"{stage}-{os.getpid()}@{settings.node}",
        "--without-gossip", "--without-mingle", "--without-heartbeat",
        "-l", os.environ.get("PRORL_LOG_LEVEL", "INFO"),
    ] + (["-E"] if settings.task_events else [])
    _app.worker_main(argv + list(extra_argv or []))
