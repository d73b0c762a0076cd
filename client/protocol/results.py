"""Frozen result types returned by the clients (plain Python, no protobuf in the public API)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.message import Message

from ...v1 import rollout_pb2 as pb
from .transports import GRPC

__all__ = ["ModelStatus", "HealthStatus", "RolloutProgress", "UpdateResult"]

_Result = TypeVar("_Result")


def _enum_suffix(enum_type, value: int, prefix: str) -> str:
    """The enum value's name without `prefix` (SERVING_STATUS_SERVING -> SERVING); for values
    this client does not know, the number."""
    try:
        return enum_type.Name(value).removeprefix(prefix)
    except ValueError:
        return str(value)


def _from_fields(cls: type[_Result], msg: Message, **given: Any) -> _Result:
    """A `cls` whose fields are `given`, or else read from the message field of the same name."""
    read = {
        field.name: getattr(msg, field.name)
        for field in dataclasses.fields(cls)  # type: ignore[arg-type]
        if field.name not in given
    }
    return cls(**read, **given)


@dataclass(frozen=True)
class ModelStatus:
    """One model hosted by the server."""

    role: str  # "ACTOR", "CRITIC", "REWARD" or "REFERENCE"
    source: str
    architecture: str
    dtype: str
    num_parameters: int
    policy_version: int

    @classmethod
    def from_proto(cls, msg: pb.ModelInfo) -> ModelStatus:
        return _from_fields(cls, msg, role=_enum_suffix(pb.ModelRole, msg.role, "MODEL_ROLE_"))


@dataclass(frozen=True)
class RolloutProgress:
    """Where the server's continuous rollout (--rollout-prompts) stands."""

    finished: bool  # every epoch / step was made and delivered or dropped
    epoch: int  # the pass over the prompt source being made, from 0
    step: int  # batches made so far
    batches_delivered: int
    batches_dropped_stale: int  # made, then dropped: its policy fell too far behind the newest
    queued_batches: int  # made, waiting for a subscriber
    subscribers: int

    @classmethod
    def from_proto(cls, msg: pb.RolloutProgress) -> RolloutProgress | None:
        """None for a server that runs no continuous rollout."""
        return _from_fields(cls, msg) if msg.enabled else None


@dataclass(frozen=True)
class HealthStatus:
    """The server's answer to the Health RPC."""

    status: str  # "LOADING", "SERVING", "WAITING_FOR_WEIGHTS" or "DRAINING"
    policy_version: int
    models: tuple[ModelStatus, ...]
    device: str
    queue_depth: int
    uptime_s: float
    server_version: str
    default_preset: str
    vocab_size: int
    max_context_tokens: int
    # The continuous rollout's progress; None when the server runs none.
    rollout: RolloutProgress | None = None
    # The UpdateWeights data planes the server accepts (protocol/transports.py).
    weight_transports: tuple[str, ...] = ()
    # How the actor generates: "rollserve" (the server's engine) or "hf"; "" while loading or
    # from a server that predates the field.
    generation_path: str = ""
    # Tokens the engine's KV cache holds; 0 on the "hf" path.
    kv_cache_tokens: int = 0
    # The server's functions that torch.compile failed on and that run eagerly since (several
    # times slower on a GPU; its log says why); () when all compiled or nothing compiles there.
    eager_fallbacks: tuple[str, ...] = ()

    @property
    def serving(self) -> bool:
        return self.status == "SERVING"

    @classmethod
    def from_proto(cls, msg: pb.HealthResponse) -> HealthStatus:
        return _from_fields(
            cls,
            msg,
            status=_enum_suffix(pb.ServingStatus, msg.status, "SERVING_STATUS_"),
            models=tuple(ModelStatus.from_proto(m) for m in msg.models),
            rollout=RolloutProgress.from_proto(msg.rollout),
            weight_transports=tuple(msg.weight_transports),
            eager_fallbacks=tuple(msg.eager_fallbacks),
        )


@dataclass(frozen=True)
class UpdateResult:
    """What an UpdateWeights call did."""

    target: str  # "ACTOR", ...
    version: int  # the version now serving
    tensors: int
    bytes: int
    server_seconds: float  # from the header's arrival to the swap
    wall_s: float  # on the client, from the first message to the reply
    # The data plane that carried it (protocol/transports.py: REPLY_TRANSPORTS).
    transport: str = GRPC

    @property
    def gb_per_s(self) -> float:
        """Applied bandwidth, 1e9 bytes per second of client wall time."""
        return self.bytes / max(self.wall_s, 1e-9) / 1e9

    @classmethod
    def from_proto(cls, msg: pb.UpdateWeightsResponse, *, wall_s: float) -> UpdateResult:
        return _from_fields(
            cls,
            msg,
            target=_enum_suffix(pb.ModelRole, msg.target, "MODEL_ROLE_"),
            server_seconds=msg.seconds,
            wall_s=wall_s,
            transport=msg.transport or GRPC,
        )
