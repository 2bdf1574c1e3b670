"""Who may do what: the API token, the backend allow-list.

The allow-list keeps the API from being used to point the farm's workers at arbitrary
addresses (a registered backend is a URL every RUN worker will POST to): only loopback,
and the hosts and networks the operator names in ``PRORL_BACKEND_ALLOW``, are accepted,
and never the farm's own Redis.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from prorl_farm.errors import ConfigError

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def is_loopback(host: str) -> bool:
    """Whether a listen address is loopback only (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def token_ok(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>`` (constant time)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              token.encode())


@dataclass(frozen=True)
class AllowList:
    networks: tuple[Network, ...]
    hosts: tuple[str, ...]

    def describe(self) -> str:
        return ", ".join(["loopback", *map(str, self.networks[len(LOOPBACK):]), *self.hosts])


def parse_allow_list(raw: str) -> AllowList:
    """``"10.0.0.0/8, gpu-node-3, 192.168.1.7"`` -> loopback plus those networks and names."""
    networks: list[Network] = list(LOOPBACK)
    hosts: list[str] = []
    for item in filter(None, (x.strip() for x in raw.split(","))):
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            if not all(part.replace("-", "").isalnum() for part in item.split(".")):
                raise ConfigError(f"PRORL_BACKEND_ALLOW: {item!r} is neither a host name, an "
                                  "address nor a CIDR") from None
            hosts.append(item.lower())
    return AllowList(tuple(networks), tuple(hosts))


def _addresses(host: str, port: int) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return {ipaddress.ip_address(host)}
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    return {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}


def _url_port(parts) -> int:
    """The URL's port (its scheme's when none is written); ValueError out of 1-65535."""
    port = parts.port  # ValueError above 65535
    if port == 0:
        raise ValueError("port 0")
    return port or (443 if parts.scheme == "https" else 80)


Address = ipaddress.IPv4Address | ipaddress.IPv6Address
# Why a URL of one of the farm's own listeners is refused (no more is said of it).
OWN_PORT = "one of the farm's own ports (its API, Gym server, Flower or Redis)"


# Seconds a reading of this host's addresses is used for (the check of every `gym`
# instance's server and every backend registration reads them).
LOCAL_ADDRESSES_S = 10.0


def local_addresses() -> frozenset[Address]:
    """This host's own addresses, every interface's (Linux: the kernel's LOCAL routes and
    IPv6 addresses), and what its name resolves to: an engine on any of them (or on
    loopback, or 0.0.0.0) is one listener, whichever of them a URL writes. Read again
    every LOCAL_ADDRESSES_S."""
    return _local_addresses(int(time.monotonic() // LOCAL_ADDRESSES_S))


@functools.lru_cache(maxsize=2)
def _local_addresses(_period: int) -> frozenset[Address]:
    found: set[Address] = set()
    try:
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
        for prev, line in zip(lines, lines[1:]):
            if "/32 host LOCAL" in line:
                found.add(ipaddress.ip_address(prev.split()[-1]))
    except (OSError, ValueError):
        pass
    try:
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            raw = line.split()[0]
            found.add(ipaddress.ip_address(":".join(raw[i:i + 4] for i in range(0, 32, 4))))
    except (OSError, ValueError, IndexError):
        pass
    try:
        found |= {ipaddress.ip_address(a) for a in
                  socket.gethostbyname_ex(socket.gethostname())[2]}
    except OSError:
        pass
    return frozenset(found)


def _identity(address: Address, local: frozenset[Address]) -> str:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    if address.is_loopback or address.is_unspecified or address in local:
        return "local"
    return str(address)


def _endpoints(host: str, port: int, local: frozenset[Address]) -> set[str]:
    if not host:
        return set()
    try:
        return {f"{_identity(a, local)}:{port}" for a in _addresses(host.lower(), port)}
    except (OSError, ValueError):
        return set()


def engine_endpoints(url: str) -> list[str]:
    """Where ``url`` reaches, normalised: ``<address>:<port>`` for each address its host
    resolves to, ``local:<port>`` for this host (loopback, 0.0.0.0, its own addresses),
    whatever scheme, case, name or spelling the URL uses. Two URLs that share one of these
    reach one listener. [] where the host does not resolve."""
    parts = urlsplit(url)
    try:
        port = _url_port(parts)
    except ValueError:
        return []
    return sorted(_endpoints(parts.hostname or "", port, local_addresses()))


def is_own_port(url: str, own: list[tuple[str, int]]) -> bool:
    """Whether ``url`` reaches one of the farm's own listeners ``own`` (host, port): its
    API, Gym server, Flower, Redis servers and sentinels. Decided by address, not by what
    answers there."""
    local = local_addresses()
    mine = {e for host, port in own for e in _endpoints(host, port, local)}
    return bool(mine & set(engine_endpoints(url)))


def backend_url_refusal(url: str, allow: AllowList,
                        own: list[tuple[str, int]]) -> str | None:
    """Why ``url`` may not be registered as a backend, or None if it may. ``own``: the
    farm's own listeners (its API, Gym server and Flower, every Redis server and sentinel:
    :func:`farm_listeners`), never a backend whatever answers there.

    A host name is allowed if it is named in the list, or if every address it resolves to
    lies in an allowed network (so a name cannot smuggle in an address the list refuses).
    """
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if not host:
        return "no host in the URL"
    try:
        port = _url_port(parts)
    except ValueError:
        return "the port is not a number from 1 to 65535"
    try:
        addresses = _addresses(host, port)
    except (OSError, ValueError) as e:
        if host in allow.hosts:
            return None  # named by the operator; registered unhealthy until it resolves
        return f"host {host!r} does not resolve ({e})"
    if is_own_port(url, own):
        return OWN_PORT
    if host in allow.hosts:
        return None
    outside = sorted(str(a) for a in addresses
                     if not any(a in net for net in allow.networks if net.version == a.version))
    if outside:
        return (f"{host} ({', '.join(outside)}) is not in the backend allow-list "
                f"({allow.describe()}); an operator can add hosts or CIDRs with "
                "PRORL_BACKEND_ALLOW")
    return None
