"""The Celery app: queues, routes and the reliability settings every process shares.

Queues: ``init`` is global; ``run.<node>`` and ``eval.<node>`` are node-local because the
sandbox INIT started lives on that node. Tasks hand a job on by task name and queue, so a
pool imports only its own stage's task module.
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from prorl_farm import redisconn
from prorl_farm.config import STAGES, Settings, load_settings

TASK_NAMES = {"init": "prorl.init", "run": "prorl.run", "eval": "prorl.eval"}


def queue_for(stage: str, node: str) -> str:
    """The queue a stage's message goes to: ``init`` everywhere, else ``<stage>.<node>``."""
    return "init" if stage == "init" else f"{stage}.{node}"


def stage_of_queue(queue: str) -> str | None:
    """The stage whose messages ``queue`` carries, or None for a queue not of the farm."""
    if queue == "init":
        return "init"
    stage, dot, node = queue.partition(".")
    return stage if dot and node and stage in ("run", "eval") else None


def create_celery_app(settings: Settings | None = None, include: list[str] | None = None
                      ) -> Celery:
    settings = settings or load_settings()
    broker, transport_options = redisconn.celery_broker(settings.redis_url) \
        if settings.redis_url else (None, {})
    app = Celery("prorl_farm", broker=broker, include=include or [])
    app.conf.update(
        # JSON only: payloads cross process and machine boundaries; never pickle.
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        # The job store holds results; Celery's result backend would only duplicate them.
        task_ignore_result=True,
        task_store_errors_even_if_ignored=False,
        # A message is acked after its stage ran; a worker lost mid-task requeues it, and
        # the stage claim turns any redelivery of a stage that ran or runs into a no-op.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout_s,
                                  **transport_options},
        broker_connection_retry_on_startup=True,
        task_default_queue="init",
        task_create_missing_queues=True,
        # This node's queues, declared so that monitors (Flower's broker page) list them;
        # workers consume only what `-Q` names.
        task_queues=[Queue(queue_for(stage, settings.node)) for stage in STAGES],
        # Flower shows tasks only when workers send events.
        worker_send_task_events=settings.task_events,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
    )
    return app


# For `celery -A prorl_farm.celery_app` (Flower, inspection). Workers build their own.
app = create_celery_app()
