"""Value parsers of the `serve` settings: one raw string in, one typed value out.

Each parser takes the text of a flag or ROLLSERVE_* variable (or `str()` of a value given in code)
and returns the normalised value ("bf16" -> "bfloat16", "64MiB" -> 67108864), or raises
argparse.ArgumentTypeError with a message argparse shows as is. Pure: no torch, no filesystem.
"""

from __future__ import annotations

import argparse
import math
import re

MIB = 1 << 20
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
GENERATION_PATHS = ("auto", "rollserve", "hf")  # server/generation/registry.py reads them
# gRPC message length options are C ints: anything above this cannot be represented.
MAX_GRPC_MESSAGE_BYTES = (1 << 31) - 1
# The longest wait a setting may ask for (about 3 years: "never", in practice). Python's waits
# (time.sleep, Condition.wait, socket timeouts) raise OverflowError past threading.TIMEOUT_MAX
# (~9.2e9 s): a larger value was accepted and then crashed the shutdown (--drain-delay-s,
# --shutdown-grace-s), every parallel update (--parallel-part-wait-s), every reward endpoint
# call (--reward-timeout-s) or the stream watchdog (--stream-send-timeout-s).
# The client bounds a call's deadline the same (client/calls.py MAX_TIMEOUT_S); the value is
# written twice because this module imports neither torch nor the client package.
MAX_SECONDS = 100_000_000.0
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "kb": 10**3,
    "mb": 10**6,
}
DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def port(raw: str) -> int:
    value = integer(raw)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {value}")
    return value


def integer(raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {raw!r}") from None


def positive_int(raw: str) -> int:
    value = integer(raw)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(raw: str) -> int:
    value = integer(raw)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def staleness(raw: str) -> int | None:
    """Versions as an integer >= 0, or "unlimited" (None: no staleness bound)."""
    if raw.strip().lower() in ("unlimited", "none"):
        return None
    return non_negative_int(raw)


def seconds(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {raw!r}") from None
    if not math.isfinite(value) or not 0 <= value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be a number in [0, {MAX_SECONDS:g}], got {raw!r}")
    return value


def positive_seconds(raw: str) -> float:
    """Seconds > 0 (a timeout of 0 would end every call at once)."""
    value = seconds(raw)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {raw!r}")
    return value


def byte_size(raw: str) -> int:
    """Bytes as an integer with an optional unit: 67108864, 64MiB, 512KiB, 1GiB."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", raw)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size (e.g. 67108864 or 64MiB): {raw!r}")
    value = int(match.group(1)) * BYTE_UNITS[unit]
    if not 1024 <= value <= MAX_GRPC_MESSAGE_BYTES:
        raise argparse.ArgumentTypeError(
            f"must be between 1KiB and {MAX_GRPC_MESSAGE_BYTES} bytes, got {value}"
        )
    return value


def _one_of(value: str, choices, what: str, raw: str) -> str:
    """`value` if it is one of `choices`, else the flag's error naming them all."""
    if value not in choices:
        raise argparse.ArgumentTypeError(f"{what} must be one of {', '.join(choices)}, got {raw!r}")
    return value


def device(raw: str) -> str:
    value = raw.strip().lower()
    if not DEVICE_RE.match(value):
        raise argparse.ArgumentTypeError(
            f"device must be auto, cpu, mps, cuda or cuda:N, got {raw!r}"
        )
    return value


def dtype(raw: str) -> str:
    value = raw.strip().lower()
    return _one_of(DTYPE_ALIASES.get(value, value), DTYPES, "dtype", raw)


def log_level(raw: str) -> str:
    return _one_of(raw.strip().upper(), LOG_LEVELS, "log level", raw)


def generation_path(raw: str) -> str:
    """auto, rollserve (the engine of server/generation) or hf (Hugging Face generate)."""
    return _one_of(raw.strip().lower(), GENERATION_PATHS, "generation path", raw)


def fraction(raw: str) -> float:
    """A share in (0, 1]."""
    try:
        value = float(raw.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {raw!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {value}")
    return value


def non_empty(raw: str) -> str:
    if raw.strip() == "":
        raise argparse.ArgumentTypeError("must not be empty")
    return raw


def preset(raw: str) -> str:
    # Imported here, not at module import: the preset table pulls in torch.
    from ..algorithms.presets import PRESET_NAMES

    return _one_of(raw.strip().lower(), PRESET_NAMES, "preset", raw)


def named(raw: str) -> str:
    name, sep, value = raw.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {raw!r}")
    return f"{name.strip()}={value.strip()}"


def token(raw: str) -> str:
    # It travels as the HTTP/2 header value "Bearer <token>": printable ASCII, no spaces.
    value = raw.strip()
    if not value or not all(33 <= ord(c) <= 126 for c in value):
        raise argparse.ArgumentTypeError("a token must be non-empty printable ASCII without spaces")
    return value


def boolean(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean (true/false/1/0): {raw!r}")


def weight_transports(raw: str) -> str:
    """Comma-separated UpdateWeights data planes, normalised; "grpc" is always on."""
    # Imported here, not at module import: importing client/ pulls in torch, and the config
    # (with `rollserve health`) must stay light.
    from ...client.protocol.transports import WEIGHT_TRANSPORTS

    names = [name.strip().lower() for name in raw.split(",") if name.strip()]
    unknown = sorted(set(names) - set(WEIGHT_TRANSPORTS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown weight transport(s) {', '.join(unknown)}; choose from "
            f"{', '.join(WEIGHT_TRANSPORTS)}"
        )
    return ",".join(name for name in WEIGHT_TRANSPORTS if name in {"grpc", *names})
