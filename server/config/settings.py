"""ServerConfig: every setting of `rollserve serve`, from flags, ROLLSERVE_* environment, defaults.

`ServerConfig.from_args(argv, environ)` is pure: it reads only its arguments (no `os.environ`, no
filesystem, no torch), so tests build configs directly and importing this module costs nothing.
Precedence is flag > environment > default. Every field `foo_bar` is the flag `--foo-bar` and the
variable `ROLLSERVE_FOO_BAR`; an empty variable counts as unset (so compose files can blank one).

Three homes: the fields and the checks across fields are here; how each value is read from text
is in values.py; the flag table (parser, help, metavar per field) is in flags.py.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NoReturn

from .flags import ENV_PREFIX, FLAGS, Flag, env_name, flag_name
from .values import DTYPES, LOG_LEVELS, MIB

__all__ = [
    "ConfigError",
    "ServerConfig",
    "ENV_PREFIX",
    "DTYPES",
    "LOG_LEVELS",
    "build_parser",
    "env_name",
    "flag_name",
]


class ConfigError(ValueError):
    """An invalid setting; the message names the flag or environment variable."""

    def __init__(self, message: str, usage: str = "") -> None:
        super().__init__(message)
        self.usage = usage


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one rollout server process."""

    host: str = "0.0.0.0"
    port: int = 50051  # 0: the OS picks a free port (see port_file)
    actor: str | None = None  # None: the built-in tiny model
    reference: str | None = None  # None: a frozen copy of the initial actor
    critic: str | None = None  # None: not loaded
    reward_model: str | None = None  # None: not loaded
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    # Generation (server/generation/registry.py): the engine for supported models on CUDA under
    # auto; the KV cache's token budget, 0: derived from gpu_memory_utilization (on CUDA, the
    # share of total device memory that what is in use plus the KV cache may reach).
    generation_path: str = "auto"
    kv_cache_tokens: int = 0
    gpu_memory_utilization: float = 0.5
    # Both directions; finite on purpose. 65 MiB: a 64 MiB weight chunk plus its framing fits.
    max_message_bytes: int = 65 * MIB
    max_new_tokens: int = 64
    default_preset: str | None = None  # None: rollserve.server.algorithms.DEFAULT_PRESET
    generate_batch_size: int = 64  # rows per generation call when a request sets none
    forward_batch_size: int = 16  # rows per scoring forward pass when a request sets none
    micro_batch_size: int = 16  # rows per streamed message when a request sets none
    max_request_rows: int = 4096  # prompts x samples_per_prompt accepted in one request
    max_queue_depth: int = 64  # requests waiting for the engine before RESOURCE_EXHAUSTED
    # Per-request limits, checked before a request is decoded (INVALID_ARGUMENT naming the field).
    max_prompts: int = 4096
    max_samples_per_prompt: int = 256
    max_new_tokens_limit: int = 4096  # the most a request may ask for; >= max_new_tokens
    # Token budgets, so that counts legal one by one cannot multiply into more than memory:
    # rows x (longest prompt + max_new_tokens) per request, and per generation or scoring batch.
    max_request_tokens: int = 16_777_216  # 16 Mi tokens
    max_batch_tokens: int = 262_144  # 256 Ki: the default 64 rows of 4096 tokens fit
    reward_fn: tuple[str, ...] = ()  # NAME=MODULE:FUNCTION reward sources
    reward_endpoint: tuple[str, ...] = ()  # NAME=URL reward sources (JSON over HTTP POST)
    reward_timeout_s: float = 30.0
    shutdown_grace_s: float = 10.0
    drain_delay_s: float = 0.0
    # An UpdateWeights stream that sends nothing for this long is ended (DEADLINE_EXCEEDED): a
    # stalled uploader would otherwise hold the update lock and the staging memory forever.
    update_idle_timeout_s: float = 60.0
    # UpdateWeights data planes besides chunks on the stream (server/weights/): "shm" (a memfd of
    # a client on this host), "dist" (InitWeightsGroup makes the server join a process group
    # at an address the admin-token caller names) and "cuda_ipc" (CUDA memory of a trainer on
    # this host; offered only when the models are on a CUDA device). "grpc" alone turns them off.
    weight_transports: str = "grpc,shm,dist,cuda_ipc"
    parallel_part_wait_s: float = 30.0  # how long a part of a parallel update waits for others
    # The longest an InitWeightsGroup rendezvous may wait, whatever timeout_s the caller asks for.
    max_group_timeout_s: float = 120.0
    # A response stream (MakeExperience, Subscribe) whose reader does not take a message for this
    # long is ended (DEADLINE_EXCEEDED): a client that never reads would hold a handler thread.
    stream_send_timeout_s: float = 30.0
    max_workers: int = 16
    log_level: str = "INFO"
    wait_for_weights: bool = False
    port_file: str | None = None
    metrics_port: int = 9090  # Prometheus /metrics over HTTP on `host`; 0: off
    # TLS: cert and key together; a client CA makes it mutual TLS (client certs required).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # Bearer tokens; none configured: authentication is off. repr=False keeps them out of logs.
    data_token: str | None = dataclasses.field(default=None, repr=False)
    admin_token: str | None = dataclasses.field(default=None, repr=False)
    data_token_file: str | None = None
    admin_token_file: str | None = None
    # Continuous rollout (server/continuous/): off unless rollout_prompts names a JSONL file.
    rollout_prompts: str | None = None
    rollout_request: str | None = None  # MakeExperienceRequest template (protobuf JSON)
    rollout_prompts_per_batch: int = 8
    rollout_epochs: int = 1  # 0: no epoch limit
    rollout_steps: int = 0  # batches to make; 0: no step limit
    rollout_seed: int = 0  # prompt shuffle and per-batch sampling seeds
    rollout_queue_batches: int = 4  # made batches waiting for a subscriber (back-pressure)
    max_staleness: int | None = 1  # versions behind the newest actor; None: unlimited

    @classmethod
    def from_args(
        cls, argv: Sequence[str], environ: Mapping[str, str], *, prog: str = "rollserve serve"
    ) -> ServerConfig:
        """Parse flags, fall back to ROLLSERVE_* variables, then to defaults; raise ConfigError."""
        parser = build_parser(prog)
        namespace = parser.parse_args(list(argv))
        values: dict[str, Any] = {}
        for field in fields(cls):
            spec = FLAGS[field.name]
            is_list = field.type.startswith("tuple")
            if hasattr(namespace, field.name):
                value = getattr(namespace, field.name)
                values[field.name] = tuple(value) if is_list else value
            elif environ.get(env_name(field.name), "") != "":
                raw = environ[env_name(field.name)]
                if is_list:
                    items = [item for item in raw.split(",") if item.strip()]
                    values[field.name] = tuple(_parse_env(field.name, spec, i) for i in items)
                else:
                    values[field.name] = _parse_env(field.name, spec, raw)
        return cls(**values)

    def __post_init__(self) -> None:
        # Programmatic construction (tests, in-process servers) gets the same checks and the same
        # normalisation ("bf16" -> "bfloat16", "info" -> "INFO") as flags and environment.
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None or (field.type == "bool" and isinstance(value, bool)):
                continue
            try:
                if field.type.startswith("tuple"):
                    normalized = tuple(FLAGS[field.name].parse(str(v)) for v in value)
                else:
                    normalized = FLAGS[field.name].parse(str(value))
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise ConfigError(f"{field.name}: {exc}") from None
            object.__setattr__(self, field.name, normalized)
        self._check_combinations()

    def _check_combinations(self) -> None:
        """Settings that are only invalid together (each one alone parsed fine)."""
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("tls_client_ca: mutual TLS needs tls_cert and tls_key as well")
        for role in ("data", "admin"):
            if getattr(self, f"{role}_token") and getattr(self, f"{role}_token_file"):
                raise ConfigError(f"{role}_token and {role}_token_file: give one, not both")
        if self.data_token is not None and self.data_token == self.admin_token:
            raise ConfigError("data_token and admin_token must differ")
        if self.rollout_request is not None and self.rollout_prompts is None:
            raise ConfigError("rollout_request: a request template needs rollout_prompts as well")
        if self.max_new_tokens > self.max_new_tokens_limit:
            raise ConfigError(
                f"max_new_tokens ({self.max_new_tokens}) is above max_new_tokens_limit "
                f"({self.max_new_tokens_limit})"
            )


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of exiting, so from_args stays pure."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message, usage=self.format_usage())


def build_parser(prog: str = "rollserve serve") -> argparse.ArgumentParser:
    """The `serve` flags. Defaults are SUPPRESS so from_args can tell "given" from "absent"."""
    parser = _Parser(
        prog=prog,
        description="Serve RLHF experience and weight updates over gRPC.",
        argument_default=argparse.SUPPRESS,
        epilog=f"Every flag --foo-bar can also be set as {ENV_PREFIX}FOO_BAR.",
    )
    defaults = ServerConfig()
    for field in fields(ServerConfig):
        spec = FLAGS[field.name]
        default = getattr(defaults, field.name)
        help_text = spec.help if default is None else f"{spec.help} (default: {default!r})"
        if field.type == "bool":
            parser.add_argument(
                flag_name(field.name), action=argparse.BooleanOptionalAction, help=help_text
            )
        elif field.type.startswith("tuple"):
            parser.add_argument(
                flag_name(field.name),
                type=spec.parse,
                metavar=spec.metavar,
                action="append",
                help=f"{spec.help}; repeatable (environment: comma-separated)",
            )
        else:
            parser.add_argument(
                flag_name(field.name), type=spec.parse, metavar=spec.metavar, help=help_text
            )
    return parser


def _parse_env(field_name: str, spec: Flag, raw: str) -> Any:
    try:
        return spec.parse(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ConfigError(f"environment variable {env_name(field_name)}: {exc}") from None
