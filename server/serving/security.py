"""Who may call what: bearer tokens with two roles, TLS / mutual TLS credentials.

Roles. `--data-token` opens MakeExperience and Rollout.Health; `--admin-token` opens UpdateWeights
and, as a superset, every data call. With no token configured at all, authentication is off (the
default, for a trainer and a server on one trusted host or network). The standard
grpc.health.v1 service and server reflection never need a token: Kubernetes probes and grpcurl
carry none, and they reveal nothing beyond "serving or not" and the public .proto. Any other
method needs at least the data token.

Tokens travel as the metadata `authorization: Bearer <token>`; over plain TCP anyone on the path
can read them, so use them with TLS (`--tls-cert`/`--tls-key`) off a loopback host. Mutual TLS
(`--tls-client-ca`) additionally requires a client certificate signed by that CA at the
transport level, before any call runs (probes then need a client certificate too).
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc

from ...client.protocol.errors import PermissionDenied, Unauthenticated
from ..config import ServerConfig

__all__ = [
    "OPEN_SERVICES",
    "AuthTokens",
    "Role",
    "SecurityConfigError",
    "authorize",
    "is_loopback",
    "load_tokens",
    "required_role",
    "security_warnings",
    "server_credentials",
]

# Services that answer without a token (see the module docstring for why).
OPEN_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)
_ADMIN_METHODS = frozenset(
    {
        "/rollserve.v1.Rollout/UpdateWeights",
        "/rollserve.v1.Rollout/UpdateWeightsAtOnce",
        # They make the server connect to an address the caller names and take weights from it.
        "/rollserve.v1.Rollout/InitWeightsGroup",
        "/rollserve.v1.Rollout/DestroyWeightsGroup",
    }
)
_BEARER = "bearer "


class SecurityConfigError(RuntimeError):
    """A TLS file or token file that cannot be used; raised before the port is bound."""


class Role(enum.Enum):
    """What a method needs: nothing, the data token (or admin), or the admin token."""

    OPEN = "open"
    DATA = "data"
    ADMIN = "admin"


@dataclass(frozen=True)
class AuthTokens:
    """The configured tokens as bytes (compared in constant time); None: that role has none."""

    data: bytes | None = None
    admin: bytes | None = None

    @property
    def enabled(self) -> bool:
        return self.data is not None or self.admin is not None

    def __repr__(self) -> str:  # never print a secret
        data, admin = ("set" if token else None for token in (self.data, self.admin))
        return f"AuthTokens(data={data}, admin={admin})"


def load_tokens(config: ServerConfig) -> AuthTokens:
    """The tokens from flags, environment or token files (files read here, at start-up)."""
    data = config.data_token or _read_token_file(config.data_token_file, "data_token_file")
    admin = config.admin_token or _read_token_file(config.admin_token_file, "admin_token_file")
    if data is not None and data == admin:
        raise SecurityConfigError("the data token and the admin token must differ")
    return AuthTokens(
        data=None if data is None else data.encode("ascii"),
        admin=None if admin is None else admin.encode("ascii"),
    )


def _read_token_file(path: str | None, name: str) -> str | None:
    if path is None:
        return None
    try:
        token = Path(path).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SecurityConfigError(f"{name}: cannot read {path}: {exc}") from None
    # The same rule as the flag: it must fit in "authorization: Bearer <token>".
    if not token or not all(33 <= ord(c) <= 126 for c in token):
        raise SecurityConfigError(
            f"{name}: {path} must hold one token of printable ASCII without spaces"
        )
    return token


def required_role(method: str) -> Role:
    """The role a full method name ("/package.Service/Method") needs."""
    service = method.lstrip("/").partition("/")[0]
    if service in OPEN_SERVICES:
        return Role.OPEN
    return Role.ADMIN if method in _ADMIN_METHODS else Role.DATA


def authorize(
    tokens: AuthTokens, method: str, metadata: tuple[tuple[str, str | bytes], ...]
) -> Unauthenticated | PermissionDenied | None:
    """None when the call may proceed, else the error to refuse it with (its code: errors.py)."""
    role = required_role(method)
    if not tokens.enabled or role is Role.OPEN:
        return None
    presented = _bearer_token(metadata)
    if presented is None:
        return Unauthenticated("missing 'authorization: Bearer <token>' metadata")
    # Compare with both tokens every time, so the time taken does not tell which one matched.
    is_admin = tokens.admin is not None and hmac.compare_digest(presented, tokens.admin)
    is_data = tokens.data is not None and hmac.compare_digest(presented, tokens.data)
    if not (is_admin or is_data):
        return Unauthenticated("invalid bearer token")
    if role is Role.ADMIN and not is_admin:
        return PermissionDenied(f"{method} needs the admin token")
    return None


def _bearer_token(metadata: tuple[tuple[str, str | bytes], ...]) -> bytes | None:
    for key, value in metadata:
        if key != "authorization":  # gRPC lower-cases metadata keys
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        if text[: len(_BEARER)].lower() == _BEARER:
            return text[len(_BEARER) :].strip().encode("latin-1")
    return None


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the PEM files (mutual when a client CA is set); None: plaintext."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    cert = _read_pem(config.tls_cert, "tls_cert")
    key = _read_pem(config.tls_key, "tls_key")
    client_ca = None
    if config.tls_client_ca is not None:
        client_ca = _read_pem(config.tls_client_ca, "tls_client_ca")
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def _read_pem(path: str, name: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"{name}: cannot read {path}: {exc}") from None
    # grpc would only fail later, in the handshake, with an opaque error: check the framing now.
    if b"-----BEGIN " not in data:
        raise SecurityConfigError(f"{name}: {path} is not a PEM file")
    return data


def is_loopback(host: str) -> bool:
    """Whether `host` (as given to --host) only accepts connections from this machine."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:  # a host name: assume it is reachable from outside
        return False


def security_warnings(config: ServerConfig, tokens: AuthTokens) -> list[str]:
    """Start-up warnings about exposures the configuration allows (empty when none)."""
    warnings = []
    tls = config.tls_cert is not None
    if not is_loopback(config.host):
        if not tokens.enabled:
            warnings.append(
                f"authentication is off on non-loopback host {config.host}: anyone who can reach "
                "the port can make experience and replace the weights (set --admin-token)"
            )
        if not tls:
            warnings.append(
                f"TLS is off on non-loopback host {config.host}: traffic"
                + (" and bearer tokens travel" if tokens.enabled else " travels")
                + " in clear text (set --tls-cert and --tls-key)"
            )
    if tokens.data is not None and tokens.admin is None:
        warnings.append("no admin token: UpdateWeights is refused to every caller")
    return warnings
