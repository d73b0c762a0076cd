"""ServerConfig: every setting of `rollserve serve`, from flags, ROLLSERVE_* environment, defaults.

`ServerConfig.from_args(argv, environ)` is pure: it reads only its arguments (no `os.environ`, no
filesystem, no torch), so tests build configs directly and importing this module costs nothing.
Precedence is flag > environment > default. Every field `foo_bar` is the flag `--foo-bar` and the
variable `ROLLSERVE_FOO_BAR`; an empty variable counts as unset (so compose files can blank one).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NoReturn

__all__ = ["ConfigError", "ServerConfig", "ENV_PREFIX", "DTYPES", "LOG_LEVELS"]

ENV_PREFIX = "ROLLSERVE_"
MIB = 1 << 20
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# gRPC message length options are C ints: anything above this cannot be represented.
_MAX_GRPC_MESSAGE_BYTES = (1 << 31) - 1
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "kb": 10**3,
    "mb": 10**6,
}
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


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
    reward_fn: tuple[str, ...] = ()  # NAME=MODULE:FUNCTION reward sources
    reward_endpoint: tuple[str, ...] = ()  # NAME=URL reward sources (JSON over HTTP POST)
    reward_timeout_s: float = 30.0
    shutdown_grace_s: float = 10.0
    drain_delay_s: float = 0.0
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
    # Continuous rollout (server/continuous.py): off unless rollout_prompts names a JSONL file.
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
            spec = _SPECS[field.name]
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
                    normalized = tuple(_SPECS[field.name].parse(str(v)) for v in value)
                else:
                    normalized = _SPECS[field.name].parse(str(value))
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


@dataclass(frozen=True)
class _Spec:
    parse: Callable[[str], Any]
    help: str
    metavar: str | None = None


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


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
        spec = _SPECS[field.name]
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


def _parse_env(field_name: str, spec: _Spec, raw: str) -> Any:
    try:
        return spec.parse(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ConfigError(f"environment variable {env_name(field_name)}: {exc}") from None


# ---- value parsers: each raises ArgumentTypeError with a message argparse shows as is ----------


def _port(raw: str) -> int:
    value = _int(raw)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {value}")
    return value


def _int(raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {raw!r}") from None


def _positive_int(raw: str) -> int:
    value = _int(raw)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(raw: str) -> int:
    value = _int(raw)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _staleness(raw: str) -> int | None:
    """Versions as an integer >= 0, or "unlimited" (None: no staleness bound)."""
    if raw.strip().lower() in ("unlimited", "none"):
        return None
    return _non_negative_int(raw)


def _seconds(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {raw!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {raw!r}")
    return value


def _byte_size(raw: str) -> int:
    """Bytes as an integer with an optional unit: 67108864, 64MiB, 512KiB, 1GiB."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", raw)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size (e.g. 67108864 or 64MiB): {raw!r}")
    value = int(match.group(1)) * _BYTE_UNITS[unit]
    if not 1024 <= value <= _MAX_GRPC_MESSAGE_BYTES:
        raise argparse.ArgumentTypeError(
            f"must be between 1KiB and {_MAX_GRPC_MESSAGE_BYTES} bytes, got {value}"
        )
    return value


def _device(raw: str) -> str:
    value = raw.strip().lower()
    if not _DEVICE_RE.match(value):
        raise argparse.ArgumentTypeError(
            f"device must be auto, cpu, mps, cuda or cuda:N, got {raw!r}"
        )
    return value


def _dtype(raw: str) -> str:
    value = raw.strip().lower()
    value = _DTYPE_ALIASES.get(value, value)
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(f"dtype must be one of {', '.join(DTYPES)}, got {raw!r}")
    return value


def _log_level(raw: str) -> str:
    value = raw.strip().upper()
    if value not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"log level must be one of {', '.join(LOG_LEVELS)}, got {raw!r}"
        )
    return value


def _non_empty(raw: str) -> str:
    if raw.strip() == "":
        raise argparse.ArgumentTypeError("must not be empty")
    return raw


def _preset(raw: str) -> str:
    # Imported here, not at module import: the preset table pulls in torch.
    from rollserve.server.algorithms.presets import PRESET_NAMES

    value = raw.strip().lower()
    if value not in PRESET_NAMES:
        raise argparse.ArgumentTypeError(
            f"preset must be one of {', '.join(PRESET_NAMES)}, got {raw!r}"
        )
    return value


def _named(raw: str) -> str:
    name, sep, value = raw.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {raw!r}")
    return f"{name.strip()}={value.strip()}"


def _token(raw: str) -> str:
    # It travels as the HTTP/2 header value "Bearer <token>": printable ASCII, no spaces.
    value = raw.strip()
    if not value or not all(33 <= ord(c) <= 126 for c in value):
        raise argparse.ArgumentTypeError("a token must be non-empty printable ASCII without spaces")
    return value


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean (true/false/1/0): {raw!r}")


_SPECS: dict[str, _Spec] = {
    "host": _Spec(_non_empty, "address to bind", "HOST"),
    "port": _Spec(_port, "port to bind; 0 picks a free one", "PORT"),
    "actor": _Spec(_non_empty, "actor (policy) model directory; unset: built-in tiny model", "DIR"),
    "reference": _Spec(_non_empty, "reference model directory; unset: copy of the actor", "DIR"),
    "critic": _Spec(_non_empty, "critic (value) model directory, one label per token", "DIR"),
    "reward_model": _Spec(_non_empty, "reward model directory, one label per sequence", "DIR"),
    "device": _Spec(_device, "auto, cpu, mps, cuda or cuda:N", "DEVICE"),
    "dtype": _Spec(_dtype, "auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16", "DTYPE"),
    "max_message_bytes": _Spec(_byte_size, "max gRPC message size, send and receive", "BYTES"),
    "max_new_tokens": _Spec(_positive_int, "default response token budget", "N"),
    "default_preset": _Spec(_preset, "algorithm preset when a request names none", "NAME"),
    "generate_batch_size": _Spec(_positive_int, "default rows per generation call", "N"),
    "forward_batch_size": _Spec(_positive_int, "default rows per scoring forward pass", "N"),
    "micro_batch_size": _Spec(_positive_int, "default rows per streamed Experience", "N"),
    "max_request_rows": _Spec(_positive_int, "most prompts x samples in one request", "N"),
    "max_queue_depth": _Spec(_positive_int, "requests queued before RESOURCE_EXHAUSTED", "N"),
    "max_prompts": _Spec(_positive_int, "most prompts in one request", "N"),
    "max_samples_per_prompt": _Spec(_positive_int, "most samples per prompt in one request", "N"),
    "max_new_tokens_limit": _Spec(_positive_int, "most max_new_tokens a request may ask", "N"),
    "reward_fn": _Spec(_named, "reward source NAME=MODULE:FUNCTION", "NAME=MODULE:FUNC"),
    "reward_endpoint": _Spec(_named, "reward source NAME=URL (JSON over HTTP POST)", "NAME=URL"),
    "reward_timeout_s": _Spec(_seconds, "timeout of one reward endpoint call", "S"),
    "shutdown_grace_s": _Spec(_seconds, "seconds in-flight calls get to finish on shutdown", "S"),
    "drain_delay_s": _Spec(_seconds, "seconds to report NOT_SERVING before refusing calls", "S"),
    "max_workers": _Spec(_positive_int, "gRPC handler threads", "N"),
    "log_level": _Spec(_log_level, "DEBUG, INFO, WARNING, ERROR or CRITICAL", "LEVEL"),
    "wait_for_weights": _Spec(_bool, "report WAITING_FOR_WEIGHTS until the first update"),
    "port_file": _Spec(_non_empty, "write the bound port to this file once bound", "PATH"),
    "metrics_port": _Spec(_port, "Prometheus metrics HTTP port on --host; 0 turns it off", "PORT"),
    "tls_cert": _Spec(_non_empty, "PEM server certificate (chain); enables TLS", "FILE"),
    "tls_key": _Spec(_non_empty, "PEM private key of --tls-cert", "FILE"),
    "tls_client_ca": _Spec(_non_empty, "PEM CA: require client certs it signed (mTLS)", "FILE"),
    "data_token": _Spec(_token, "bearer token for MakeExperience and Health", "TOKEN"),
    "admin_token": _Spec(_token, "bearer token for UpdateWeights (and every data call)", "TOKEN"),
    "data_token_file": _Spec(_non_empty, "read --data-token from this file", "FILE"),
    "admin_token_file": _Spec(_non_empty, "read --admin-token from this file", "FILE"),
    "rollout_prompts": _Spec(
        _non_empty, "JSONL prompt source of the continuous rollout (Subscribe)", "FILE"
    ),
    "rollout_request": _Spec(
        _non_empty, "MakeExperienceRequest template without prompts, protobuf JSON", "FILE"
    ),
    "rollout_prompts_per_batch": _Spec(_positive_int, "prompts per rollout batch", "N"),
    "rollout_epochs": _Spec(_non_negative_int, "passes over the prompts; 0: no limit", "N"),
    "rollout_steps": _Spec(_non_negative_int, "rollout batches to make; 0: no limit", "N"),
    "rollout_seed": _Spec(_non_negative_int, "seed of the prompt shuffle and sampling", "N"),
    "rollout_queue_batches": _Spec(_positive_int, "made batches held for subscribers", "N"),
    "max_staleness": _Spec(
        _staleness, "drop rollout batches this many versions behind; or unlimited", "N"
    ),
}
