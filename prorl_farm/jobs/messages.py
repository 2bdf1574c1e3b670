"""Stage messages written straight into kombu's Redis lists, inside the farm's own
transactions and scripts.

A farm stage message is a Celery (protocol 2) task message ``prorl.<stage>(job_id, token)``
with the token as its task id. Published the usual way (``send_task``), each one costs a
Python round of Celery and kombu plumbing and its own Redis round trip (kombu builds a new
client per publish), and it lands *after* the job state that announces it, so a crash in
between leaves a job without its message. Here the envelope kombu's Redis transport would
push is built from a template made once per stage with Celery's own ``as_task_v2``, and the
job store pushes it with the job's state change, in one transaction (a submission) or one
script (a hand-off): a message exists exactly when its job says it waits for it.

The envelope matches what ``send_task`` pushes (``tests/test_submit.py`` compares them
field by field), and workers consume it like any other message.
"""

from __future__ import annotations

import base64
import json
import os

from prorl_farm.celery_app import TASK_NAMES

# Stand-ins replaced per message; none can occur in a template by accident.
_JOB, _TOKEN, _TAG, _QUEUE, _BODY = ("@@job@@", "@@token@@", "@@tag@@", "@@queue@@",
                                     "@@body@@")


class StageMessages:
    """Builds the raw Redis list entries of farm stage messages for one Celery app."""

    def __init__(self, app):
        self._templates: dict[str, tuple[str, str]] = {}
        for stage, name in TASK_NAMES.items():
            # As send_task calls it (ignore_result None: the app's setting decides).
            msg = app.amqp.as_task_v2(_TOKEN, name, args=[_JOB, _TOKEN], kwargs={},
                                      ignore_result=None)
            args, kwargs, embed = msg.body
            body = json.dumps([args, kwargs, embed])
            envelope = {
                "body": _BODY,
                "content-encoding": "utf-8",
                "content-type": "application/json",
                "headers": msg.headers,
                "properties": dict(msg.properties, delivery_mode=2,
                                   delivery_info={"exchange": "", "routing_key": _QUEUE},
                                   priority=0, body_encoding="base64", delivery_tag=_TAG),
            }
            self._templates[stage] = (json.dumps(envelope), body)

    def payload(self, stage: str, queue: str, job_id: str, token: str) -> str:
        """The list entry of ``prorl.<stage>(job_id, token)`` for ``queue`` (the list of
        the same name; the farm publishes at kombu's default priority only)."""
        envelope, body = self._templates[stage]
        job_id, token, queue = _json_safe(job_id), _json_safe(token), _json_safe(queue)
        encoded = base64.b64encode(
            body.replace(_JOB, job_id).replace(_TOKEN, token).encode()).decode()
        return (envelope.replace(_BODY, encoded).replace(_JOB, job_id)
                .replace(_TOKEN, token).replace(_QUEUE, queue)
                .replace(_TAG, os.urandom(16).hex()))


def _json_safe(text: str) -> str:
    """``text`` as it goes between the quotes of a JSON string."""
    return text if text.isalnum() else json.dumps(text)[1:-1]
