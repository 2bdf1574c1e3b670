"""A Redis primary, a replica and three sentinels on loopback: what `prorl-farm up` runs with
``PRORL_REDIS_HA=1``, and what the failover test kills the primary of.

The layout lives in one directory: ``ha.json`` (the five ports, chosen once and kept, so a
second `up` finds the same service), each server's data directory and config file, and
each sentinel's. Redis and Sentinel rewrite their config files at a failover (the promoted
replica forgets its ``replicaof``, the sentinels record the new primary, its replica and
each other), so a restart resumes the roles as they last were; a server that comes back
as an old primary is turned into a replica by the sentinels.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis

from prorl_farm import keys
from prorl_farm.errors import ConfigError
from prorl_farm.redisconn import SENTINEL_SCHEME

SERVICE = "prorl"
SERVERS = ("a", "b")
SENTINELS = ("s1", "s2", "s3")
QUORUM = 2


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Member:
    """One process of the trio: its name, argv and log file."""

    name: str
    argv: list[str]
    log: Path


class RedisHA:
    """The five processes' layout under ``data``; the caller starts and stops them."""

    def __init__(self, data: Path, appendfsync: str = "everysec", down_after_ms: int = 5000,
                 failover_timeout_ms: int = 60_000, password: str | None = None):
        if not shutil.which("redis-server"):
            raise ConfigError("redis-server not found: install it (apt-get install "
                              "redis-server) or set PRORL_REDIS_URL")
        self.data = Path(data)
        self.data.mkdir(parents=True, exist_ok=True)
        layout = self.data / "ha.json"
        if layout.exists():
            self.ports = json.loads(layout.read_text())
        else:
            self.ports = {name: free_port() for name in SERVERS + SENTINELS}
            layout.write_text(json.dumps(self.ports) + "\n")
        self.appendfsync = appendfsync
        # Every server and sentinel asks for it (in their config files, 0600, never on a
        # command line): the farm's Redis is the farm's alone on a shared host.
        self.password = password
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{self.ports[s]}" for s in SENTINELS)
        if not self.password:
            return f"{SENTINEL_SCHEME}://{hosts}/{SERVICE}/0"
        secret = quote(self.password, safe="")
        return f"{SENTINEL_SCHEME}://:{secret}@{hosts}/{SERVICE}/0?sentinel_password={secret}"

    def _sentinel(self, name: str) -> redis.Redis:
        return redis.Redis(port=self.ports[name], socket_timeout=1, socket_connect_timeout=1,
                           password=self.password, decode_responses=True)

    def _auth_lines(self, conf: Path, sentinel: bool) -> None:
        """The password's lines in ``conf`` (added to a file an earlier run wrote without
        them; one Redis or Sentinel rewrote keeps them in its own quoting), and the file
        0600."""
        if self.password:
            text = conf.read_text()
            if not any(line.split()[:1] == ["requirepass"] for line in text.splitlines()):
                lines = [f"requirepass {self.password}"]
                lines.append(f"sentinel auth-pass {SERVICE} {self.password}" if sentinel
                             else f"masterauth {self.password}")
                conf.write_text(text.rstrip("\n") + "\n" + "\n".join(lines) + "\n")
        conf.chmod(0o600)

    def members(self) -> list[Member]:
        """The processes to start, servers first; config files written where missing (a
        config Redis or Sentinel rewrote is theirs and kept)."""
        out = []
        for name in SERVERS:
            conf = self.data / f"{name}.conf"
            if not conf.exists():
                (self.data / name).mkdir(exist_ok=True)
                lines = [
                    f"port {self.ports[name]}", "bind 127.0.0.1", f"dir {self.data / name}",
                    "appendonly yes", f"appendfsync {self.appendfsync}", 'save ""',
                    f"hash-max-listpack-value {keys.HASH_MAX_LISTPACK_VALUE}",
                    "daemonize no",
                    # a replica (re)joining syncs at once, not after 5 s of waiting for others
                    "repl-diskless-sync-delay 0"]
                if name != SERVERS[0]:
                    lines.append(f"replicaof 127.0.0.1 {self.ports[SERVERS[0]]}")
                conf.write_text("\n".join(lines) + "\n")
            self._auth_lines(conf, sentinel=False)
            out.append(Member(f"redis-{name}", ["redis-server", str(conf)],
                              self.data / f"{name}.log"))
        sentinel = (["redis-sentinel"] if shutil.which("redis-sentinel")
                    else ["redis-server"])
        for name in SENTINELS:
            conf = self.data / f"{name}.conf"
            if not conf.exists():
                conf.write_text("\n".join([
                    f"port {self.ports[name]}", "bind 127.0.0.1", f"dir {self.data}",
                    "daemonize no",
                    f"sentinel monitor {SERVICE} 127.0.0.1 {self.ports[SERVERS[0]]} {QUORUM}",
                    f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}",
                    f"sentinel failover-timeout {SERVICE} {self.failover_timeout_ms}",
                    f"sentinel parallel-syncs {SERVICE} 1",
                    # Known from the start, not learnt over the first ~10 s of hellos and
                    # INFO rounds: the replica, and the other sentinels by their ids.
                    f"sentinel myid {self._sentinel_id(name)}",
                    *(f"sentinel known-replica {SERVICE} 127.0.0.1 {self.ports[r]}"
                      for r in SERVERS[1:]),
                    *(f"sentinel known-sentinel {SERVICE} 127.0.0.1 {self.ports[o]} "
                      f"{self._sentinel_id(o)}" for o in SENTINELS if o != name)]) + "\n")
            self._auth_lines(conf, sentinel=True)
            argv = sentinel + [str(conf)] + (["--sentinel"] if sentinel[0] == "redis-server"
                                              else [])
            out.append(Member(f"sentinel-{name}", argv, self.data / f"{name}.log"))
        return out

    def _sentinel_id(self, name: str) -> str:
        return hashlib.sha1(f"{self.data}\0{name}\0{self.ports[name]}".encode()).hexdigest()

    def primary(self) -> str | None:
        """The name of the server the sentinels' majority names as primary, or None."""
        votes: dict[int, int] = {}
        for s in SENTINELS:
            c = self._sentinel(s)
            try:
                addr = c.sentinel_get_master_addr_by_name(SERVICE)
                if addr:
                    votes[int(addr[1])] = votes.get(int(addr[1]), 0) + 1
            except redis.exceptions.RedisError:
                pass
            finally:
                c.close()
        for port, n in votes.items():
            if n >= QUORUM:
                return next((name for name in SERVERS if self.ports[name] == port), None)
        return None

    def ready(self) -> bool:
        """The primary answers, its replica is in sync, and every sentinel knows the
        replica and the two other sentinels (a failover can happen)."""
        name = self.primary()
        if name is None:
            return False
        try:
            for s in SENTINELS:
                c = self._sentinel(s)
                try:
                    master = c.sentinel_master(SERVICE)
                    replicas = c.sentinel_slaves(SERVICE)
                finally:
                    c.close()
                if int(master.get("num-other-sentinels", 0)) < len(SENTINELS) - 1:
                    return False
                if not any(r.get("master-link-status") == "ok" for r in replicas):
                    return False
            return True
        except redis.exceptions.RedisError:
            return False

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        end = time.monotonic() + timeout_s
        while not self.ready():
            if time.monotonic() > end:
                raise TimeoutError(f"the Redis trio in {self.data} is not ready "
                                   f"(primary: {self.primary()})")
            time.sleep(0.1)
