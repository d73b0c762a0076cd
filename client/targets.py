"""Replica targets: "host:port" strings as given, "dns:///name:port" resolved to one per address.

A "dns:" target is resolved with the system resolver (socket.getaddrinfo) into one replica per
distinct address, so a Kubernetes headless service names every pod behind it. Resolution happens
when ReplicatedRolloutClient is built and on its `refresh()`.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

from .protocol.errors import Unavailable

__all__ = ["ReplicaAddress", "as_target_list", "resolve_addresses", "resolve_targets"]


@dataclass(frozen=True)
class ReplicaAddress:
    """One replica to dial, and the DNS name it came from (None for a target given as is)."""

    target: str  # "10.0.0.7:50051", "[fd00::7]:50051" or "host:50051"
    dns_name: str | None = None  # the name it was resolved from
    port: int = 0

    @property
    def authority(self) -> str:
        host = f"[{self.dns_name}]" if ":" in (self.dns_name or "") else self.dns_name
        return f"{host}:{self.port}"


def _split_host_port(hostport: str, original: str) -> tuple[str, int]:
    if hostport.startswith("["):  # [v6]:port
        host, sep, port = hostport[1:].partition("]:")
    else:
        host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{original!r}: expected dns:///name:port with an explicit port")
    return host, int(port)


def _expand(target: str) -> list[ReplicaAddress]:
    """A "dns:" target becomes one address per distinct resolved IP; others stay as they are."""
    if not target.startswith("dns:"):
        return [ReplicaAddress(target)]
    rest = target.removeprefix("dns:")
    if rest.startswith("//"):
        authority, _, rest = rest[2:].partition("/")
        if authority:  # a custom DNS server: getaddrinfo cannot ask one
            raise ValueError(f"{target!r}: a DNS server authority is not supported; use dns:///")
    host, port = _split_host_port(rest, target)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise Unavailable(f"cannot resolve {target}: {exc}") from None
    addresses: dict[str, ReplicaAddress] = {}  # insertion-ordered set
    for family, _, _, _, sockaddr in infos:
        ip = str(sockaddr[0])
        dial = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        addresses.setdefault(dial, ReplicaAddress(dial, host, port))
    return list(addresses.values())


def resolve_addresses(targets: Sequence[str]) -> list[ReplicaAddress]:
    resolved: dict[str, ReplicaAddress] = {}
    for target in targets:
        for address in _expand(target):
            resolved.setdefault(address.target, address)
    return list(resolved.values())


def resolve_targets(targets: str | Sequence[str]) -> tuple[str, ...]:
    """The distinct replica addresses of `targets`, in order ("dns:///" names resolved)."""
    return tuple(a.target for a in resolve_addresses(as_target_list(targets)))


def as_target_list(targets: str | Sequence[str]) -> list[str]:
    listed = [targets] if isinstance(targets, str) else list(targets)
    if not listed or not all(isinstance(t, str) and t for t in listed):
        raise ValueError(f"targets must be one or more non-empty strings, got {targets!r}")
    return listed
