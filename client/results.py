"""Frozen result types returned by the clients (plain Python, no protobuf in the public API)."""

from __future__ import annotations

from dataclasses import dataclass

from ..v1 import rollout_pb2 as pb

__all__ = ["ModelStatus", "HealthStatus", "UpdateResult"]


def _enum_suffix(enum_type, value: int, prefix: str) -> str:
    """The enum value's name without `prefix` (SERVING_STATUS_SERVING -> SERVING); for values
    this client does not know, the number."""
    try:
        return enum_type.Name(value).removeprefix(prefix)
    except ValueError:
        return str(value)


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
        return cls(
            role=_enum_suffix(pb.ModelRole, msg.role, "MODEL_ROLE_"),
            source=msg.source,
            architecture=msg.architecture,
            dtype=msg.dtype,
            num_parameters=msg.num_parameters,
            policy_version=msg.policy_version,
        )


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

    @property
    def serving(self) -> bool:
        return self.status == "SERVING"

    @classmethod
    def from_proto(cls, msg: pb.HealthResponse) -> HealthStatus:
        return cls(
            status=_enum_suffix(pb.ServingStatus, msg.status, "SERVING_STATUS_"),
            policy_version=msg.policy_version,
            models=tuple(ModelStatus.from_proto(m) for m in msg.models),
            device=msg.device,
            queue_depth=msg.queue_depth,
            uptime_s=msg.uptime_s,
            server_version=msg.server_version,
            default_preset=msg.default_preset,
            vocab_size=msg.vocab_size,
            max_context_tokens=msg.max_context_tokens,
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
    transport: str = "grpc"  # the data plane: "grpc", "grpc-parallel", "shm" or "dist"

    @property
    def gb_per_s(self) -> float:
        """Applied bandwidth, 1e9 bytes per second of client wall time."""
        return self.bytes / max(self.wall_s, 1e-9) / 1e9

    @classmethod
    def from_proto(cls, msg: pb.UpdateWeightsResponse, *, wall_s: float) -> UpdateResult:
        return cls(
            target=_enum_suffix(pb.ModelRole, msg.target, "MODEL_ROLE_"),
            version=msg.version,
            tensors=msg.tensors,
            bytes=msg.bytes,
            server_seconds=msg.seconds,
            wall_s=wall_s,
            transport=msg.transport or "grpc",
        )
