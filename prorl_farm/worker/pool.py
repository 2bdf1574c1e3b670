"""Worker pool processes: `prorl-farm worker init|run|eval`.

Each pool is one Celery worker process consuming one queue with its own pool type and
concurrency, importing only its own stage's task module (``workers/<stage>/tasks.py``).
A plain ``celery worker`` that consumes exactly one farm queue works the same way (its
stage is read from that queue); one that consumes none or several is refused at start.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from celery import Celery
from celery.exceptions import WorkerShutdown
from celery.signals import worker_process_init, worker_ready, worker_shutting_down

from prorl_farm import keys, redisconn
from prorl_farm.celery_app import create_celery_app, queue_for, stage_of_queue
from prorl_farm.config import STAGES, Settings, load_settings
from prorl_farm.errors import StageFailed
from prorl_farm.graders import answers
from prorl_farm.handlers.registry import HandlerRegistry
from prorl_farm.jobs.messages import StageMessages
from prorl_farm.jobs.payloads import open_store
from prorl_farm.jobs.store import JobStore
from prorl_farm.llm.registry import BackendRegistry
from prorl_farm.sandbox import cgroups, warm_graders
from prorl_farm.states import Reap, StageOutcome
from prorl_farm.watchdog import Watchdog
from prorl_farm.worker import logs
from prorl_farm.worker.broker import transport_for
from prorl_farm.worker.liveness import Liveness, present
from prorl_farm.worker.reaper import Reaper, left_reason
from prorl_farm.worker.runner import StageRunner
from prorl_farm.worker.warm import WarmPool

log = logging.getLogger(__name__)

# Pools whose Celery consumer runs kombu's event loop, and their queue poll's timeout.
EVENT_LOOP_POOLS = ("threads", "prefork", "solo")
IDLE_POLL_S = 5
# The slots a pool registers without fair share: more than any queue holds, so every job
# takes one at once (first come, first served, as the queue's list has them).
UNGATED = 1 << 30
# The most reads of its queue a leaving pool makes (each hands back what the last one left).
LEAVE_SWEEPS = 20


class WorkerFarm:
    """Everything one pool process shares between its task threads."""

    def __init__(self, app: Celery, settings: Settings, stage: str, main_process: bool):
        self.app = app
        self.settings = settings
        self.stage = stage
        # One connection per pool thread at most, plus the liveness and probe threads.
        self.store = JobStore.from_settings(
            settings, settings.pool(stage).concurrency + settings.reserve_slots(stage) + 8)
        self.messages = StageMessages(app)
        payloads = open_store(settings)
        reaper = (Reaper(self.store, settings, self.messages, BackendRegistry(self.store.r),
                         present if settings.presence else None, payloads)
                  if main_process else None)
        self.liveness = Liveness(self.store, settings, stage,
                                 reserved=_reserved_requests if main_process else None,
                                 reaper=reaper)
        worker_name = f"{socket.gethostname()}:{os.getpid()}"
        self.backends = BackendRegistry(self.store.r, audit=settings.backend_audit)
        self.sandboxes = _sandbox_manager(self.store.r, settings)
        if main_process and self.sandboxes is not None:
            self.liveness.janitor = self.sandboxes.janitor
        if main_process and _watchdog is not None:
            self.liveness.watchdog = _watchdog
        registry = HandlerRegistry(settings.handlers)
        self.runner = StageRunner(settings, self.store, registry,
                                  self.liveness, self.messages, worker_name,
                                  self.backends,
                                  self.sandboxes, payloads)
        # INIT's warm sandboxes (the READY stage): every INIT process takes them; the main
        # one builds them.
        self.warm = None
        if stage == "init" and settings.warm_pool > 0 and self.sandboxes is not None:
            self.warm = self.runner.warm = WarmPool(self.store, settings, registry,
                                                    self.sandboxes)
            if main_process:
                self.warm.start()

    def leave(self) -> int:
        """This node is going away (PRORL_REQUEUE_ON_STOP and SIGTERM): re-queue at INIT,
        for another node, every job this pool holds and every job waiting on its node's
        queue; the stages still running them are aborted (their token moved on). Returns
        how many jobs were re-queued."""
        node = self.settings.node
        held = set(self.liveness.running_pairs()) | set(_reserved_requests())
        self.liveness.register_slots(leaving=True)  # nothing more is handed to this node
        n = sum(hand_back(self.store, self.messages, self.stage, node, job_id, token)
                for job_id, token in sorted(held))
        if self.stage != "init":
            n += hand_back_waiting(self.store, self.messages, self.stage, node)
        self.liveness.tick()  # aborts the stages still running those jobs
        log.warning("%s pool on %s leaving: %d job(s) re-queued for other nodes", self.stage,
                    node, n)
        return n


def hand_back(store: JobStore, messages: StageMessages, stage: str, node: str, job_id: str,
              token: str) -> bool:
    """Re-queue one job at INIT for another node (``stage``'s pool on ``node`` is leaving):
    lua/reap.lua's 'leave', which spends none of its re-queues."""
    outcome, _ = store.reap(job_id, "leave", float("inf"), token, queue_for(stage, node),
                            left_reason(stage, node), messages)
    return outcome is Reap.REQUEUE


def hand_back_waiting(store: JobStore, messages: StageMessages, stage: str, node: str,
                      rounds: int = LEAVE_SWEEPS) -> int:
    """Hand back every job waiting on the queue of ``stage``'s pool on ``node``, its list
    and its pens read in one step (lua/leave_sweep.lua, which also marks the queue left),
    again until a read finds nothing: a stage that finished on the node meanwhile may have
    handed it one more. What arrives after the last read the reaper hands back (the queue's
    left mark). Returns how many were re-queued."""
    queue = queue_for(stage, node)
    n = 0
    for _ in range(rounds):
        waiting = store.leave_sweep(queue)
        if not waiting:
            break
        n += sum(hand_back(store, messages, stage, node, job_id, token)
                 for job_id, token in waiting)
    return n


def _sandbox_manager(r, settings: Settings):
    """This node's SandboxManager, or None (logged) if its runtime cannot run here."""
    from prorl_farm.sandbox.manager import SandboxManager

    try:
        return SandboxManager(r, settings.node, settings.sandbox_runtime, settings.sandbox_dir,
                              settings.sandbox_max, user=settings.sandbox_user,
                              python=settings.sandbox_python,
                              ro_paths=settings.sandbox_ro_paths,
                              mount_roots=settings.sandbox_mount_roots,
                              allow_network=settings.sandbox_network,
                              image=settings.sandbox_image,
                              trusted_roots=(settings.swe_env_dir,),
                              scratch_mb=settings.memory_scratch_mb()[0],
                              workspace_mb=settings.sandbox_workspace_mb)
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
_watchdog: Watchdog | None = None  # started by worker_main, fed by the liveness thread
_reserving = False  # started by worker_main: it runs the reserve workers (fair_reserve)


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


def execute_stage(stage: str, job_id: str, token: str) -> str:
    """The body of a stage task. A stage that failed its job ends in Celery's FAILURE state
    (the job store is already updated, and the message is acked: nothing runs again), so
    Flower and Celery's events tell failed jobs from finished ones."""
    farm = get_farm(stage)
    if _shutdown_requested and farm.settings.requeue_on_stop:
        # Delivered while this node leaves: never start it here (its sandboxes are going).
        hand_back(farm.store, farm.messages, stage, farm.settings.node, job_id, token)
        return "handed back: this node is leaving"
    result = farm.runner(stage, job_id, token)
    if result.outcome is StageOutcome.FAILED and result.failure is not None:
        raise StageFailed(*result.failure)
    if result.outcome is StageOutcome.ABORTED:
        raise StageFailed("aborted", result.detail or "the job ended elsewhere")
    return str(result)


def _consumed_stage(consumer) -> str:
    """The farm stage of the one queue a worker consumes; refuses anything else."""
    try:
        names = [q.name for q in consumer.task_consumer.queues]
    except AttributeError:
        names = []
    stages = {stage_of_queue(n) for n in names} - {None}
    if len(stages) != 1 or len(names) != 1:
        raise WorkerShutdown(
            f"a farm worker consumes exactly one farm queue (init, run.<node> or "
            f"eval.<node>), not {names}: start it with `prorl-farm worker <stage>`")
    return stages.pop()


@worker_ready.connect
def _on_ready(sender=None, **_):
    global _stage, _main_pid
    if not _stage:
        # A plain `celery worker`: this process is the pool's main process, of the stage
        # of the queue it consumes; it heartbeats, reaps and runs the janitor like any.
        _stage = _consumed_stage(sender)
        _main_pid = os.getpid()
    farm = get_farm()
    # The slots it takes of its queue: its prefetch (concurrency times the multiplier);
    # started by worker_main, its reserve workers' share of that is kept for tenants under
    # their share (lib/fair.lua).
    settings, pool = farm.settings, farm.settings.pool(_stage)
    taken = getattr(sender, "initial_prefetch_count", 0) or (
        pool.concurrency * pool.prefetch_multiplier)
    reserve = settings.reserve_slots(_stage) * pool.prefetch_multiplier if _reserving else 0
    shared = max(1, taken - reserve) if settings.fair_share else UNGATED
    farm.liveness.slots = (queue_for(_stage, settings.node), shared, reserve)
    farm.liveness.register_slots()
    log.info("%s pool ready on node %s (%d slots shared, %d in reserve)", _stage,
             settings.node, shared, reserve)


@worker_process_init.connect
def _on_child(**_):
    global _farm
    _farm = None  # forked from the main process: build our own clients and thread


_shutdown_requested = False
_leaving: threading.Thread | None = None
LEAVE_WAIT_S = 30  # how long a stopping pool waits, at its end, for its hand-back to finish


@worker_shutting_down.connect
def _on_shutdown(**_):
    """SIGTERM (or SIGINT/SIGQUIT): Celery sends this from its signal handler, in the main
    thread, which may hold any lock at that moment (a Redis connection pool's, the
    liveness's, logging's). So the leave runs in a thread of its own (a second signal starts
    nothing), and the pool waits for it before it exits (:func:`worker_main`). A leave
    done in the handler itself once never finished (no hand-back logged, the process
    killed at Slurm's kill wait): its jobs waited out the stale time and spent a re-queue."""
    global _shutdown_requested, _leaving
    _shutdown_requested = True
    if _farm is not None and _leaving is None:
        _leaving = threading.Thread(target=_leave, args=(_farm,), name="leave", daemon=True)
        _leaving.start()


def _leave(farm: WorkerFarm) -> None:
    leaving = farm.settings.requeue_on_stop and os.getpid() == _main_pid
    if leaving:
        try:
            farm.leave()
        except Exception:
            log.exception("could not re-queue this pool's jobs; the reaper will")
    warm_graders.close_graders()  # idle ones now; a busy one as its grading ends
    if farm.warm is not None:
        try:
            farm.warm.close()  # its warm sandboxes are nobody's: stopped now
        except Exception:
            log.exception("could not stop the warm sandboxes; they expire")
    farm.liveness.stop()
    if leaving:  # gone at once for /readyz, the dashboard and the reaper
        farm.store.r.zrem(keys.POOLS, f"{farm.stage}:{farm.settings.node}")


def _check_backends(settings: Settings) -> None:
    """Before a RUN pool takes a job: the backends registered (by this run, or by a
    previous life of the farm whose Redis kept them) whose server or tokenizer is gone
    leave the heap, so no job is pinned to them (the reaper probes them again later)."""
    client = redisconn.client(settings.redis_url, decode_responses=True, socket_timeout=10,
                              socket_connect_timeout=10)
    try:
        down, up = BackendRegistry(client).probe_all()
        if down or up:
            log.warning("backends checked at start: out of the heap %s, back in it %s",
                        down, up)
    except Exception as e:  # noqa: BLE001 - Redis not up yet: the reaper's probes do it
        log.warning("could not check the registered backends at start: %s", e)
    finally:
        client.close()


def worker_main(stage: str, extra_argv: list[str] | None = None) -> None:
    """Run the pool for ``stage`` in the foreground until SIGTERM."""
    global _app, _stage, _main_pid, _watchdog, _reserving
    if stage not in STAGES:
        raise SystemExit(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")
    settings = load_settings()
    if not settings.redis_url:
        raise SystemExit("PRORL_REDIS_URL must be set for a worker pool")
    logs.install(settings.log_level)
    pool = settings.pool(stage)
    _stage = stage
    _main_pid = os.getpid()
    _watchdog = Watchdog(settings.watchdog_s, f"{stage}:{settings.node}")
    _app = create_celery_app(settings, include=[f"workers.{stage}.tasks"])
    _app.conf.worker_prefetch_multiplier = pool.prefetch_multiplier
    _reserving = True
    # kombu's Redis transport with deliveries tracked in memory, not in Redis (broker.py):
    # the pools are what reserve and ack messages. Other processes (the API, Flower) keep
    # kombu's own, whose URL monitors know (Flower's broker page reads it off the app).
    _app.conf.broker_transport = transport_for(settings.redis_url)
    if pool.pool in EVENT_LOOP_POOLS:
        # An idle pool's one standing Redis call: a BRPOP that times out every few seconds
        # (kombu's default, 1 s, costs an idle node a command a second per pool). Its event
        # loop takes a message the moment it lands whatever the timeout; gevent and
        # eventlet pools poll (and sleep between polls), so they keep the default.
        _app.conf.broker_transport_options = {**_app.conf.broker_transport_options,
                                              "polling_interval": IDLE_POLL_S}
    if stage == "run":
        _check_backends(settings)
    cpu_farm = cgroups.farm_cpu_id(settings.redis_url, settings.node)
    if settings.tenant_cpu:  # the node's pools in a CPU group of their own (docs/sharing.md)
        cgroups.join_farm_cpu(cpu_farm)
    try:
        _app.worker_main(_celery_argv(stage, settings) + list(extra_argv or []))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    raise SystemExit(_ended(stage, code, cpu_farm))


def _celery_argv(stage: str, settings: Settings) -> list[str]:
    """`celery worker`'s arguments for the stage's pool on this node."""
    pool = settings.pool(stage)
    argv = [
        "worker", "-Q", queue_for(stage, settings.node), "-P", pool.pool,
        "-c", str(pool.concurrency + settings.reserve_slots(stage)),
        "-n", f"{stage}-{os.getpid()}@{settings.node}",
        "--without-gossip", "--without-mingle",
        "-l", settings.log_level,
    ]
    # With task events (for Flower) the worker also sends its heartbeat events, without which
    # monitors know no workers and count no active tasks; without events neither is sent.
    return argv + (["-E"] if settings.task_events else ["--without-heartbeat"])


def _ended(stage: str, code: int, cpu_farm) -> int:
    """After Celery's worker returned: the leave finished, the helpers and CPU groups
    released; the exit status (1 where the pool stopped without being asked to)."""
    if _leaving is not None:
        _leaving.join(LEAVE_WAIT_S)
    # The node's CPU groups of tenants (sandbox/cgroups.py), if this was its last pool: the
    # answer-grading helpers, which sit in the group they last graded for, go first.
    answers.close_helpers()
    warm_graders.close_graders()
    cgroups.release_farm_cpu(cpu_farm)
    if code == 0 and not _shutdown_requested:
        # Celery gave up by itself (e.g. "Unrecoverable error" while reconnecting after a
        # Redis restart) and would exit 0: a supervisor that restarts on failure (systemd,
        # Slurm, compose) must see a failure.
        log.critical("the %s pool stopped without being asked to; exiting with status 1",
                     stage)
        code = 1
    return code
