"""The INIT stage task: claim, run the handler's ``init``, hand on. Thin by design."""

from celery import shared_task

from prorl_farm.worker import execute_stage


@shared_task(name="prorl.init", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def init_stage(job_id: str, token: str) -> str:
    return execute_stage("init", job_id, token)
