"""Where the farm's Redis is: one URL (``PRORL_REDIS_URL``), a single server or a Sentinel
service, and the clients every part of the farm makes from it.

Two forms:

- ``redis://[[user]:password@]host:port/db`` (and ``rediss://``, ``unix://``): one server,
  as redis-py reads it.
- ``redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]``: the
  sentinels that watch ``service``; the farm talks to whichever server they name as its
  primary, and follows a failover. ``?sentinel_password=...`` when the sentinels have a
  password of their own (the userinfo is the data servers').

Every client of the farm's own (the job store, the pools' presence connections, the
reaper, the API, the gateway, the Gym server) comes from :func:`client`; Celery's broker
(the API's publisher, the pools' consumers, Flower) from :func:`celery_broker`. A client
of a Sentinel service asks the sentinels for the primary at every new connection: a
connection to a primary that died fails, is retried (docs/architecture.md, "Redis
failover") and opens on the new one; one to a primary that was demoted answers READONLY,
which redis-py turns into a connection error, retried the same way.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, quote, unquote, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection

from prorl_farm.errors import ConfigError

SENTINEL_SCHEME = "redis+sentinel"
PLAIN_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_PORT = 26379
# A failed command is retried with backoff growing to this many seconds between tries.
BACKOFF_CAP_S = 1.0
# Seconds a command to a single server is retried at most: one that went away comes back by
# a restart, which the farm's processes ride by exiting and being restarted (tests/
# test_faults.py), not by holding every caller for a failover's time.
SINGLE_SERVER_RETRY_S = 1.5
# Seconds a call to a sentinel may take (they answer from memory; a dead one is skipped).
SENTINEL_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Target:
    """A parsed ``PRORL_REDIS_URL``: one server (``sentinels`` empty) or a Sentinel
    service."""

    url: str
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None

    @property
    def ha(self) -> bool:
        return bool(self.sentinels)

    def shown(self) -> str:
        """The URL without its passwords (for logs and the startup banner)."""
        if not self.ha:
            parts = urlsplit(self.url)
            if parts.password:
                netloc = parts.netloc.rsplit("@", 1)[1]
                return parts._replace(netloc=f"{parts.username or ''}:***@{netloc}").geturl()
            return self.url
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"{SENTINEL_SCHEME}://{hosts}/{self.service}/{self.db}"


def parse(url: str) -> Target:
    """``url`` read, or a ConfigError that says what is wrong with it."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in PLAIN_SCHEMES:
        try:
            redis.connection.parse_url(url)
        except ValueError as e:
            raise ConfigError(f"PRORL_REDIS_URL: {e}") from None
        return Target(url)
    if scheme != SENTINEL_SCHEME:
        raise ConfigError(
            f"PRORL_REDIS_URL: scheme {scheme or '(none)'!r} is not one of "
            f"{', '.join(PLAIN_SCHEMES + (SENTINEL_SCHEME,))} (a Sentinel service: "
            f"{SENTINEL_SCHEME}://host:26379,host:26379/SERVICE/DB)")
    rest = url.split("://", 1)[1]
    hosts_part, _, path_query = rest.partition("/")
    path, _, query = path_query.partition("?")
    userinfo, at, hosts = hosts_part.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    sentinels = []
    for h in hosts.split(","):
        host, colon, port = h.strip().rpartition(":") if ":" in h else (h.strip(), "", "")
        host = host.strip("[]")
        if not host:
            raise ConfigError(f"PRORL_REDIS_URL: a sentinel without a host in {hosts!r}")
        try:
            sentinels.append((host, int(port) if port else SENTINEL_PORT))
        except ValueError:
            raise ConfigError(f"PRORL_REDIS_URL: sentinel port {port!r} is not a number") \
                from None
    segments = [unquote(s) for s in path.split("/") if s]
    if not segments:
        raise ConfigError("PRORL_REDIS_URL: a Sentinel URL names its service: "
                          f"{SENTINEL_SCHEME}://host:26379/SERVICE/DB")
    if len(segments) > 2 or (len(segments) == 2 and not segments[1].isdigit()):
        raise ConfigError(f"PRORL_REDIS_URL: expected /SERVICE or /SERVICE/DB, got /{path}")
    options = {k: v[-1] for k, v in parse_qs(query).items()}
    unknown = set(options) - {"sentinel_password"}
    if unknown:
        raise ConfigError(f"PRORL_REDIS_URL: unknown option(s) {', '.join(sorted(unknown))} "
                          "(known: sentinel_password)")
    return Target(url, tuple(sentinels), segments[0],
                  int(segments[1]) if len(segments) == 2 else 0, username, password,
                  options.get("sentinel_password"))


def endpoints(url: str | None) -> list[tuple[str, int]]:
    """The (host, port) pairs the farm reaches its Redis at: the server, or the sentinels
    (a unix socket: none)."""
    if not url:
        return []
    target = parse(url)
    if target.ha:
        return list(target.sentinels)
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return []
    return [(parts.hostname or "127.0.0.1", parts.port or 6379)]


# Seconds the sentinels' answer of a service's servers is used for (the check of every `gym`
# instance's server and every backend registration reads it).
SERVERS_KNOWN_S = 10.0


def all_endpoints(url: str | None) -> list[tuple[str, int]]:
    """Every (host, port) the farm's Redis listens at: :func:`endpoints`, and for a
    Sentinel service also its primary and replicas as the sentinels know them (asked again
    every SERVERS_KNOWN_S; a backend registration refuses each: prorl_farm/access.py)."""
    if not url or not parse(url).ha:
        return endpoints(url)
    return list(_sentinel_service_endpoints(url, int(time.monotonic() // SERVERS_KNOWN_S)))


@functools.lru_cache(maxsize=4)
def _sentinel_service_endpoints(url: str, _period: int) -> tuple[tuple[str, int], ...]:
    out = endpoints(url)
    target = parse(url)
    for host, port in target.sentinels:
        client = redis.Redis(host=host, port=port, password=target.sentinel_password,
                             socket_timeout=SENTINEL_TIMEOUT_S, decode_responses=True,
                             socket_connect_timeout=SENTINEL_TIMEOUT_S)
        try:
            primary = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME",
                                             target.service)
            replicas = client.execute_command("SENTINEL", "REPLICAS", target.service)
        except redis.RedisError:
            continue
        finally:
            client.close()
        if primary:
            out.append((primary[0], int(primary[1])))
        for row in replicas or []:
            fields = dict(zip(row[::2], row[1::2])) if isinstance(row, list) else row
            if fields.get("ip") and fields.get("port"):
                out.append((fields["ip"], int(fields["port"])))
    return tuple(sorted(set(out)))


def retry(failover_s: float) -> Retry:
    """Retries that span ``failover_s``: backoff from 50 ms doubling to BACKOFF_CAP_S."""
    tries, waited, wait = 0, 0.0, 0.05
    while waited < failover_s:
        waited += min(wait, BACKOFF_CAP_S)
        wait *= 2
        tries += 1
    return Retry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=0.05), retries=max(tries, 1))


class SentinelConnection(SentinelManagedConnection):
    """A connection to a Sentinel service's primary that asks the sentinels where the
    primary is at every (re)connect. redis-py's own asks only in ``connect()``, while a
    command retried on the same connection reconnects through ``connect_check_health`` to
    the address it had: a dead primary's, for ever (redis-py 8.2)."""

    def connect_check_health(self, check_health: bool = True,
                             retry_socket_connect: bool = True):
        if not self._sock and self.connection_pool.is_master:
            self.host, self.port = self.connection_pool.get_master_address()
        return super().connect_check_health(check_health=check_health,
                                            retry_socket_connect=retry_socket_connect)


class SentinelBlockingConnectionPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """A Sentinel service's connections, callers waiting for a free one (as
    ``BlockingConnectionPool`` does) rather than failing for want of one."""


def client(url: str, *, failover_s: float = 0.0, blocking: bool = False,
           max_connections: int | None = None, pool_timeout_s: float = 30.0,
           single_connection_client: bool = False, **kwargs) -> redis.Redis:
    """A client of the farm's Redis at ``url``. ``failover_s`` > 0: commands that fail on a
    lost connection are retried over that long (a Sentinel failover; a single server at
    most SINGLE_SERVER_RETRY_S); ``blocking``: callers wait up to ``pool_timeout_s`` for a
    free connection of the ``max_connections``. Other keyword arguments go to each
    connection (decode_responses, socket_timeout, client_name...).

    The retries are the connections' own: redis-py ignores a client's ``retry`` when it is
    given a pool."""
    target = parse(url)
    if not target.ha:
        failover_s = min(failover_s, SINGLE_SERVER_RETRY_S)
    if failover_s > 0:
        kwargs.setdefault("retry", retry(failover_s))
        kwargs.setdefault("retry_on_error", [redis.exceptions.ConnectionError,
                                             redis.exceptions.TimeoutError])
    if max_connections is not None:
        kwargs["max_connections"] = max_connections
    if blocking:
        kwargs["timeout"] = pool_timeout_s
    if not target.ha:
        pool_class = redis.BlockingConnectionPool if blocking else redis.ConnectionPool
        pool = pool_class.from_url(url, **kwargs)
    else:
        sentinel = Sentinel(
            list(target.sentinels),
            sentinel_kwargs=dict(password=target.sentinel_password,
                                 socket_timeout=SENTINEL_TIMEOUT_S,
                                 socket_connect_timeout=SENTINEL_TIMEOUT_S))
        pool_class = SentinelBlockingConnectionPool if blocking else SentinelConnectionPool
        pool = pool_class(target.service, sentinel, db=target.db, username=target.username,
                          password=target.password, connection_class=SentinelConnection,
                          **kwargs)
    out = redis.Redis(connection_pool=pool, single_connection_client=single_connection_client)
    # The pool is this client's own: its close() closes the pool's sockets too (as
    # Redis.from_url's does). redis-py leaves a pool it was given open, to the garbage
    # collector, which then closes the sockets wherever it runs (a ResourceWarning there).
    out.auto_close_connection_pool = True
    return out


def celery_broker(url: str) -> tuple[str, dict]:
    """Celery's broker URL for ``url`` and the transport options it needs (kombu's Sentinel
    transport: ``sentinel://host:port;sentinel://...`` and ``master_name``)."""
    target = parse(url)
    if not target.ha:
        return url, {}
    auth = ""
    if target.password is not None:
        auth = f"{quote(target.username or '', safe='')}:{quote(target.password, safe='')}@"
    broker = ";".join(f"sentinel://{auth}{h}:{p}/{target.db}" for h, p in target.sentinels)
    options: dict = {"master_name": target.service}
    if target.sentinel_password is not None:
        options["sentinel_kwargs"] = {"password": target.sentinel_password}
    return broker, options
