"""The `rollserve` command: `serve` runs a server, `health` probes one (a Docker HEALTHCHECK).

Heavy imports (torch, transformers) happen only inside `serve`: `rollserve health` runs every few
seconds in a container and must start in a fraction of a second. `rollserve serve --help` ends
with the exit codes (exit_codes.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ..config.values import positive_seconds
from .exit_codes import ExitCode, exit_codes_help

__all__ = ["COMMANDS", "check_health", "main"]

COMMANDS = ("serve", "health")


def main(
    argv: Sequence[str] | None = None,
    *,
    default_command: str | None = None,
    prog: str = "rollserve",
) -> int:
    """Entry point of the console script; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if default_command is not None and (not args or args[0] not in (*COMMANDS, "-h", "--help")):
        args.insert(0, default_command)
    parser = argparse.ArgumentParser(prog=prog, description="RLHF rollout service over gRPC.")
    parser.add_argument("command", choices=COMMANDS, help="serve: run a server; health: probe one")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="options of the command (-h)")
    namespace = parser.parse_args(args)
    if namespace.command == "serve":
        return _serve(namespace.args, prog=f"{prog} serve")
    return _health(namespace.args, prog=f"{prog} health")


def _serve(args: list[str], prog: str) -> int:
    from ..config import ConfigError, ServerConfig, build_parser

    if "-h" in args or "--help" in args:
        print(build_parser(prog).format_help())
        print(exit_codes_help())
        return ExitCode.DRAINED
    try:
        config = ServerConfig.from_args(args, os.environ, prog=prog)
    except ConfigError as exc:
        # argparse's own format and exit status for a usage error.
        sys.stderr.write(exc.usage)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    from ..engine.readiness import ReadinessError
    from ..models import ModelLoadError
    from .app import BindError, serve
    from .security import SecurityConfigError

    try:
        return serve(config)
    except (ModelLoadError, BindError, SecurityConfigError, ReadinessError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return ExitCode.START_FAILED


def _health(args: list[str], prog: str) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description="Exit 0 only when grpc.health.v1 Check answers SERVING."
    )
    parser.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of the server")
    # The serve flags' parser: finite and bounded. gRPC turns a deadline past ~7e9 s (inf
    # included) into DEADLINE_EXCEEDED at once: the probe reported a serving server as down.
    parser.add_argument("--timeout-s", type=positive_seconds, default=5.0, help="deadline")
    parser.add_argument("--service", default="", help='service name; "" is the whole server')
    # The health service needs no token, but TLS is below it: a TLS server needs a TLS probe.
    parser.add_argument("--tls-ca", metavar="FILE", help="PEM CA of the server's TLS certificate")
    parser.add_argument("--tls-cert", metavar="FILE", help="PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-key", metavar="FILE", help="PEM key of --tls-cert")
    namespace = parser.parse_args(args)
    if (namespace.tls_cert is None) != (namespace.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if namespace.tls_cert is not None and namespace.tls_ca is None:
        parser.error("--tls-cert needs --tls-ca")
    try:
        tls = _read_tls_files(namespace.tls_ca, namespace.tls_cert, namespace.tls_key)
    except OSError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    status = check_health(namespace.target, namespace.service, namespace.timeout_s, tls=tls)
    print(f"{namespace.target}: {status}")
    return 0 if status == "SERVING" else 1


def _read_tls_files(
    ca: str | None, cert: str | None, key: str | None
) -> tuple[bytes, bytes | None, bytes | None] | None:
    if ca is None:
        return None
    with open(ca, "rb") as ca_file:
        root = ca_file.read()
    if cert is None or key is None:
        return root, None, None
    with open(cert, "rb") as cert_file, open(key, "rb") as key_file:
        return root, cert_file.read(), key_file.read()


def check_health(
    target: str,
    service: str,
    timeout_s: float,
    *,
    tls: tuple[bytes, bytes | None, bytes | None] | None = None,
) -> str:
    """The grpc.health.v1 status name of `service` at `target`, or the RPC's error code name.

    `tls`: (CA, client certificate or None, client key or None) as PEM bytes; None: plaintext.
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if tls is None:
        channel = grpc.insecure_channel(target)
    else:
        root, chain, key = tls
        credentials = grpc.ssl_channel_credentials(
            root_certificates=root, private_key=key, certificate_chain=chain
        )
        channel = grpc.secure_channel(target, credentials)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return exc.code().name  # UNAVAILABLE (nothing listens), NOT_FOUND, DEADLINE_EXCEEDED
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
