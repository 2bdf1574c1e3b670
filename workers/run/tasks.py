"""The RUN stage task: claim, run the handler's ``run``, hand on. Thin by design."""

from celery import shared_task

from prorl_farm.worker import execute_stage


@shared_task(name="prorl.run", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_stage(job_id: str, token: str) -> str:
    return execute_stage("run", job_id, token)
