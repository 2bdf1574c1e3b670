"""The RUN stage task: claim, run the handler's ``run``, hand on. Thin by design."""

from celery import shared_task

from prorl_farm.worker import get_farm


@shared_task(name="prorl.run", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_stage(job_id: str, token: str) -> str:
    return get_farm("run").runner("run", job_id, token)
