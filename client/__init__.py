"""rollserve.client: the thin trainer-side library of rollserve (grpcio, protobuf, torch,
safetensors; never transformers).

    from rollserve.client import RolloutClient
    with RolloutClient("gpu-node:50051") as client:
        client.wait_until_ready(timeout_s=120)
        exp = client.make_experience(prompts, samples_per_prompt=4, rewards=["exact_match"],
                                     gt_answers=answers)
        ...train on exp...
        client.update_weights(policy.state_dict(), version=step)

The options of a request are keyword arguments (above) or one frozen dataclass
(`ExperienceOptions`, `UpdateOptions`), the same for every client. A LoRA update sends the
adapter's tensors with `mode="lora", lora=LoraAdapter(rank=..., alpha=...)`.

AsyncRolloutClient is the same surface for asyncio; ReplicatedRolloutClient spreads experience
calls over several servers and fans weight updates out to all of them.
"""

# A LoRA update's adapter: rank, alpha (the target modules come from the tensor names).
from ..v1.rollout_pb2 import LoraAdapter
from .aio import AsyncRolloutClient
from .buffer import ExperienceBuffer
from .calls import SubscribedBatch
from .client import RolloutClient
from .kl_controller import AdaptiveKLController, FixedKLController, mean_kl
from .protocol.codec import decode_tensor, encode_tensor
from .protocol.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    RolloutError,
    TensorCodecError,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from .protocol.experience import (
    BufferItem,
    Experience,
    concat_experiences,
    make_experience_batch,
    split_experience_batch,
)
from .protocol.requests import ExperienceOptions, UpdateOptions, build_make_experience_request
from .protocol.results import HealthStatus, ModelStatus, RolloutProgress, UpdateResult
from .protocol.reward_moments import RunningRewardMoments
from .replicas import (
    ReplicaHealth,
    ReplicatedRolloutClient,
    ReplicaUpdateError,
    resolve_targets,
)
from .weights.distributed import WeightsGroup

__all__ = [
    "RolloutClient",
    "SubscribedBatch",
    "ExperienceBuffer",
    "AsyncRolloutClient",
    "ReplicatedRolloutClient",
    "WeightsGroup",
    "resolve_targets",
    "Experience",
    "BufferItem",
    "split_experience_batch",
    "make_experience_batch",
    "concat_experiences",
    "build_make_experience_request",
    "ExperienceOptions",
    "UpdateOptions",
    "RunningRewardMoments",
    "LoraAdapter",
    "HealthStatus",
    "ModelStatus",
    "RolloutProgress",
    "UpdateResult",
    "ReplicaHealth",
    "FixedKLController",
    "AdaptiveKLController",
    "mean_kl",
    "encode_tensor",
    "decode_tensor",
    "RolloutError",
    "InvalidArgument",
    "FailedPrecondition",
    "ResourceExhausted",
    "Unavailable",
    "Unauthenticated",
    "PermissionDenied",
    "DeadlineExceeded",
    "Cancelled",
    "Unimplemented",
    "Internal",
    "TensorCodecError",
    "ReplicaUpdateError",
]
