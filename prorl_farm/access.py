"""Who may do what: the API token, the backend allow-list.

The allow-list keeps the API from being used to point the farm's workers at arbitrary
addresses (a registered backend is a URL every RUN worker will POST to): only loopback,
and the hosts and networks the operator names in ``PRORL_BACKEND_ALLOW``, are accepted,
and never the farm's own Redis.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from dataclasses import dataclass
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


def backend_url_refusal(url: str, allow: AllowList,
                        redis_endpoints: list[tuple[str, int]]) -> str | None:
    """Why ``url`` may not be registered as a backend, or None if it may.
    ``redis_endpoints``: the farm's Redis as the farm reaches it (its server, or a Sentinel
    service's sentinels: redisconn.endpoints), never a backend.

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
    for redis_host, redis_port in redis_endpoints:
        try:
            redis_addresses = _addresses(redis_host, redis_port)
        except OSError:
            redis_addresses = set()
        if redis_port == port and addresses & redis_addresses:
            return "that is the farm's own Redis"
    if host in allow.hosts:
        return None
    outside = sorted(str(a) for a in addresses
                     if not any(a in net for net in allow.networks if net.version == a.version))
    if outside:
        return (f"{host} ({', '.join(outside)}) is not in the backend allow-list "
                f"({allow.describe()}); an operator can add hosts or CIDRs with "
                "PRORL_BACKEND_ALLOW")
    return None
