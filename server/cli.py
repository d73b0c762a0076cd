"""The `rollserve` command: `serve` runs a server, `health` probes one (a Docker HEALTHCHECK).

Heavy imports (torch, transformers) happen only inside `serve`: `rollserve health` runs every few
seconds in a container and must start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

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
    from rollserve.server.config import ConfigError, ServerConfig

    try:
        config = ServerConfig.from_args(args, os.environ, prog=prog)
    except ConfigError as exc:
        # argparse's own format and exit status for a usage error.
        sys.stderr.write(exc.usage)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    from rollserve.server.app import BindError, serve
    from rollserve.server.models import ModelLoadError

    try:
        return serve(config)
    except (ModelLoadError, BindError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1


def _health(args: list[str], prog: str) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description="Exit 0 only when grpc.health.v1 Check answers SERVING."
    )
    parser.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of the server")
    parser.add_argument("--timeout-s", type=_positive_seconds, default=5.0, help="deadline")
    parser.add_argument("--service", default="", help='service name; "" is the whole server')
    namespace = parser.parse_args(args)
    status = check_health(namespace.target, namespace.service, namespace.timeout_s)
    print(f"{namespace.target}: {status}")
    return 0 if status == "SERVING" else 1


def check_health(target: str, service: str, timeout_s: float) -> str:
    """The grpc.health.v1 status name of `service` at `target`, or the RPC's error code name."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return exc.code().name  # UNAVAILABLE (nothing listens), NOT_FOUND, DEADLINE_EXCEEDED
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def _positive_seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {raw!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {raw!r}")
    return value
