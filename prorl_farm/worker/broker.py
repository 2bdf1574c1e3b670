"""The pools' kombu Redis transport: deliveries tracked in memory, none in Redis.

kombu's Redis transport records every delivered message in its ``unacked`` hash and
``unacked_index`` sorted set and drops both on the ack: four commands and two round trips
per message, twelve commands per job of three stages, to cover a message whose worker dies
before acking it. The farm covers that case itself, so here kombu's ack emulation is off
(``ack_emulation = False``: kombu's in-memory QoS) and the pop is the only broker command a
delivery costs:

- a message its worker *claimed* is the job's attempt, held under the worker's heartbeats
  (lua/claim.lua); a dead worker's jobs are re-queued by the reaper (*active*);
- a message its worker *reserved* (prefetched, not yet running) is heartbeated by the pool's
  liveness thread from its first tick on (worker/liveness.py), so the same holds;
- a message popped by a worker that died before either is found by the reaper's *lost*
  test (lua/popped.lua): the queue's index holds each waiting job by push time, and a queue
  is FIFO, so of its N indexed jobs with L messages on the list, the N - L oldest have been
  popped; one that stays popped, unclaimed and unheartbeated for the stale age is lost.

What kombu's ack emulation did besides: a message rejected with requeue (a prefork child
lost mid-task) and the reserved messages of a worker that shuts down warm are pushed back
from memory (kombu's virtual QoS). Each push-back goes through :meth:`Channel._restore`,
which moves the job's entry in its queue's index to the time of the new push, so the index
stays in push order for the *lost* test.

Used by the pools' Celery apps through ``broker_transport`` (worker/pool.py). A plain
``celery worker`` on kombu's own transport still works: the reaper reads kombu's unacked
records too (*orphan*).
"""

from __future__ import annotations

import logging

from kombu.transport import redis as kombu_redis

from prorl_farm.lua import Scripts
from prorl_farm.redisconn import parse
from prorl_farm.worker.kombu import message_args

log = logging.getLogger(__name__)


class FarmChannel:
    """What the farm's channels change of kombu's (mixed into its plain and Sentinel
    channels)."""

    ack_emulation = False

    def _restore(self, message, leftmost=False):
        """Push a delivered, unacked message back onto its queue (kombu's virtual QoS calls
        this for a reject with requeue and at shutdown), its job re-indexed at the push.
        Always at the back (``leftmost`` is not followed): the queue's index says the job
        was pushed now, and the list must agree for the lost-message test."""
        queue = message.delivery_info.get("routing_key") or ""
        payload = message.serializable()
        payload["redelivered"] = True
        try:
            args = message_args(payload)
        except (ValueError, TypeError, KeyError):
            args = []
        if len(args) != 2 or not queue:
            super()._restore(message)  # not a farm stage message: kombu's own push
            return
        lua = getattr(self, "_farm_lua", None)
        if lua is None:
            lua = self._farm_lua = Scripts(self.client)
        lua("restore_message", queue=queue, job=str(args[0]),
            message=kombu_redis.dumps(payload))
        log.info("message of job %s pushed back onto %s", args[0], queue)


class Channel(FarmChannel, kombu_redis.Channel):
    pass


class SentinelChannel(FarmChannel, kombu_redis.SentinelChannel):
    pass


class Transport(kombu_redis.Transport):
    Channel = Channel


class SentinelTransport(kombu_redis.SentinelTransport):
    Channel = SentinelChannel


# For Celery's ``broker_transport`` (kombu resolves "module:Class").
TRANSPORT = f"{__name__}:Transport"


def transport_for(redis_url: str) -> str:
    """Celery's ``broker_transport`` for the farm's Redis at ``redis_url``."""
    return f"{__name__}:SentinelTransport" if parse(redis_url).ha else TRANSPORT
