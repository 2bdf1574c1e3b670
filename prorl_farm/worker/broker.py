"""kombu's Redis transport, with its unacked bookkeeping sent as plain pipelines.

kombu records each delivered message in its ``unacked`` hash and ``unacked_index`` sorted
set and drops both on the ack, each pair inside MULTI/EXEC: 8 commands per message, 24 per
job of three stages, half of them the MULTI and EXEC around two commands that need no
transaction. Here the pair goes as one pipeline without them (the same round trip).

Nothing reads the pair as a unit while it is half written: kombu restores an entry only
once its index score is older than the visibility timeout (hours; a pair being written is
this instant's), under a WATCH of the hash, and finds a missing hash value as a message
already gone; the reaper (worker/kombu.py) reads the index, then the hash, and skips a tag
whose message is not there yet. A restore (restore_by_tag) keeps its own transaction: it
passes its pipeline in.

Used by the pools' Celery apps through ``broker_transport`` (worker/pool.py).
"""

from __future__ import annotations

from contextlib import contextmanager

from kombu.transport import redis as kombu_redis


class QoS(kombu_redis.QoS):
    @contextmanager
    def pipe_or_acquire(self, pipe=None, client=None):
        if pipe:
            yield pipe
        else:
            with self.channel.conn_or_acquire(client) as client:
                yield client.pipeline(transaction=False)


class Channel(kombu_redis.Channel):
    QoS = QoS


class Transport(kombu_redis.Transport):
    Channel = Channel


# For Celery's ``broker_transport`` (kombu resolves "module:Class").
TRANSPORT = f"{__name__}:Transport"
