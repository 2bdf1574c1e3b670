"""The EVAL stage task: claim, run the handler's ``eval``, hand on. Thin by design."""

from celery import shared_task

from prorl_farm.worker import get_farm


@shared_task(name="prorl.eval", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def eval_stage(job_id: str, token: str) -> str:
    return get_farm("eval").runner("eval", job_id, token)
