"""The options of the two requests a trainer makes, each written once as a frozen dataclass.

`ExperienceOptions` holds every option of a MakeExperience request but the prompts,
`UpdateOptions` every option of an UpdateWeights call but the weights, their version and the
progress callback. The sync, asyncio and replicated clients take either the dataclass or its
fields as keyword arguments (`make_experience(prompts, samples_per_prompt=4)`), and the server's
in-process maker builds its requests with the same `build_make_experience_request`, so the same
arguments mean the same request whether the experience is made locally or remotely.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ...v1 import rollout_pb2 as pb
from .errors import InvalidArgument
from .reward_moments import RunningRewardMoments
from .roles import wire_role
from .transports import AUTO, CLIENT_TRANSPORTS, CUDA_IPC

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_CHUNK_BYTES",
    "MAX_STREAMS",
    "MIN_CHUNK_BYTES",
    "ExperienceOptions",
    "Progress",
    "Prompts",
    "RewardRecipe",
    "UpdateOptions",
    "build_make_experience_request",
]

# Token-id prompts (one list of ids per prompt) or text prompts.
Prompts = Sequence[Sequence[int]] | Sequence[str]
# {"exact_match": 1.0, "reward_model": 0.5} or ["exact_match"] (weight 1 each).
RewardRecipe = Mapping[str, float] | Sequence[str]
# progress(sent_bytes, total_bytes), called as an update's bytes go out.
Progress = Callable[[int, int], None]

# An update's file travels in chunks of this many bytes (the last one shorter).
MIN_CHUNK_BYTES = 256 * 1024
MAX_CHUNK_BYTES = 64 * 1024 * 1024
DEFAULT_CHUNK_BYTES = 1024 * 1024
# Parallel gRPC streams one update may take at most.
MAX_STREAMS = 64

_ALGORITHM_FIELDS = frozenset(pb.AlgorithmOptions.DESCRIPTOR.fields_by_name)
_Options = TypeVar("_Options", "ExperienceOptions", "UpdateOptions")


def _merged(cls: type[_Options], options: _Options | None, fields: Mapping[str, Any]) -> _Options:
    """`options` (default: all defaults) with `fields` replaced; TypeError for an unknown name."""
    base = cls() if options is None else options
    return dataclasses.replace(base, **fields) if fields else base


# ---- MakeExperience ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ExperienceOptions:
    """Every option of a MakeExperience request but the prompts; None means the server's
    default (the preset's, for sampling and algorithm)."""

    gt_answers: Sequence[str] | None = None  # one per prompt, for rule-based rewards
    samples_per_prompt: int | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    stop_sequences: Sequence[Sequence[int]] = ()  # token-id sequences that end a response
    stop_strings: Sequence[str] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs_use_temperature: bool | None = None
    apply_chat_template: bool = False  # text prompts only
    preset: str | None = None
    # AlgorithmOptions field names to values, e.g. {"advantage_estimator": "group_norm"}.
    algorithm: Mapping[str, object] | None = None
    # LightRFT's running reward moments before this request (with algorithm
    # reward_running_norm): the previous request's RunningRewardMoments.from_experience.
    reward_moments: RunningRewardMoments | None = None
    rewards: RewardRecipe | None = None
    micro_batch_size: int = 0  # 0: the server's
    generate_batch_size: int = 0
    forward_batch_size: int = 0
    return_entropy: bool = False
    return_texts: bool = False
    min_policy_version: int = 0  # refuse (FailedPrecondition) while the server's is older
    request_id: str = ""  # also sent as x-request-id call metadata

    def __post_init__(self) -> None:
        # A lone string iterates as its characters: gt_answers="42" was sent as ["4", "2"],
        # stop_strings="</a>" stopped at any of "<", "/", "a", ">".
        for name in ("gt_answers", "stop_strings"):
            _check_strings(name, getattr(self, name))
        if isinstance(self.rewards, (str, bytes)):
            raise TypeError(
                f"rewards must be a list of source names or a {{name: weight}} mapping, got "
                f"{self.rewards!r}"
            )
        if self.algorithm is not None and not isinstance(self.algorithm, Mapping):
            raise TypeError(
                f"algorithm must be a mapping of AlgorithmOptions fields, got {self.algorithm!r}"
            )
        unknown = set(self.algorithm or {}) - _ALGORITHM_FIELDS
        if unknown:
            raise TypeError(f"unknown algorithm options {sorted(unknown)}; see AlgorithmOptions")
        if "reward_moments" in (self.algorithm or {}):
            raise TypeError("pass reward_moments= (a RunningRewardMoments), not in algorithm")

    @classmethod
    def of(cls, options: ExperienceOptions | None = None, **fields: Any) -> ExperienceOptions:
        """`options` with `fields` replaced (keyword names as the fields'); the defaults when
        `options` is None."""
        return _merged(cls, options, fields)

    def request(self, prompts: Prompts) -> pb.MakeExperienceRequest:
        """The MakeExperienceRequest of `prompts` with these options."""
        request = pb.MakeExperienceRequest(
            min_policy_version=self.min_policy_version, request_id=self.request_id
        )
        _set_prompts(request, prompts, self.apply_chat_template)
        if self.gt_answers is not None:
            request.gt_answers.extend(self.gt_answers)
        _set_optional(request, samples_per_prompt=self.samples_per_prompt)
        self._set_sampling(request.sampling)
        _set_optional(request.algorithm, preset=self.preset, **(self.algorithm or {}))
        if self.reward_moments is not None:
            request.algorithm.reward_moments.CopyFrom(self.reward_moments.to_proto())
        _set_rewards(request, self.rewards)
        for name in ("micro_batch_size", "generate_batch_size", "forward_batch_size"):
            _set(request.batching, name, getattr(self, name))
        request.outputs.action_entropy = self.return_entropy
        request.outputs.response_texts = self.return_texts
        return request

    def _set_sampling(self, sampling: pb.SamplingOptions) -> None:
        _set_optional(
            sampling,
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            logprobs_use_temperature=self.logprobs_use_temperature,
        )
        for index, sequence in enumerate(self.stop_sequences):
            ids = _token_ids(f"stop_sequences[{index}]", sequence)
            sampling.stop_sequences.add(token_ids=ids)
        sampling.stop_strings.extend(self.stop_strings)
        sampling.ignore_eos = self.ignore_eos


def build_make_experience_request(
    prompts: Prompts, options: ExperienceOptions | None = None, **fields: Any
) -> pb.MakeExperienceRequest:
    """One MakeExperienceRequest: `options` and/or the fields of ExperienceOptions as keywords."""
    return ExperienceOptions.of(options, **fields).request(prompts)


def _check_strings(name: str, values: Sequence[str] | None) -> None:
    # Items are checked in a sequence only: checking would use up a one-shot iterator.
    if isinstance(values, (str, bytes)) or (
        isinstance(values, Sequence) and not all(isinstance(v, str) for v in values)
    ):
        raise TypeError(f"{name} must be a list of strings, got {values!r:.120}")


def _token_ids(name: str, ids: Any) -> list[int]:
    """A sequence of integer token ids (ints, numpy or torch integers) as a list of ints.

    int() was used before: it truncated float ids (1.9 -> 1) and parsed strings ("7" -> 7), and
    bytes (b"hi") iterated as token ids 104, 105; now each is a TypeError naming `name`.
    """
    if isinstance(ids, (str, bytes, bytearray)):
        raise TypeError(f"{name}: expected a sequence of integer token ids, got {ids!r:.120}")
    try:
        return [operator.index(i) for i in ids]
    except TypeError:
        raise TypeError(
            f"{name}: expected a sequence of integer token ids, got {ids!r:.120}"
        ) from None


def _set_prompts(request: pb.MakeExperienceRequest, prompts: Prompts, chat: bool) -> None:
    # One string (or bytes) iterates as characters: make_experience("Hi") sent two prompts.
    if isinstance(prompts, (str, bytes)):
        raise TypeError(
            f"prompts must be a list of prompts (strings or token-id lists), got {prompts!r:.120}"
        )
    prompts = list(prompts)
    if prompts and all(isinstance(p, str) for p in prompts):
        request.texts.texts.extend(prompts)
        request.texts.apply_chat_template = chat
        return
    if any(isinstance(p, str) for p in prompts):
        raise TypeError("prompts must be all strings or all sequences of token ids")
    if chat:
        raise TypeError("apply_chat_template needs text prompts")
    request.token_ids.SetInParent()  # an empty batch is still a token-id batch
    for index, prompt in enumerate(prompts):
        ids = _token_ids(f"prompts[{index}]", prompt)
        request.token_ids.values.extend(ids)
        request.token_ids.lengths.append(len(ids))


def _set_rewards(request: pb.MakeExperienceRequest, rewards: RewardRecipe | None) -> None:
    if rewards is None:
        return
    items = rewards.items() if isinstance(rewards, Mapping) else ((name, None) for name in rewards)
    for source, weight in items:
        term = request.rewards.add(source=source)
        if weight is not None:
            term.weight = float(weight)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _set_optional(message, **fields: object) -> None:
    """Set the fields whose value is not None (proto3 `optional` keeps "unset" distinct)."""
    for name, value in fields.items():
        if value is not None:
            _set(message, name, value)


def _set(message, name: str, value: object) -> None:
    """setattr, with protobuf's own range and type errors naming the field (seed=-1 raised
    "Value out of range: -1" and nothing more)."""
    try:
        setattr(message, name, value)
    except (ValueError, TypeError) as error:
        raise type(error)(f"{name}: {error}") from None


# ---- UpdateWeights -----------------------------------------------------------------------------


@dataclass(frozen=True)
class UpdateOptions:
    """Every option of an UpdateWeights call but the weights, their version and the progress
    callback; checked when made, so a bad one fails before a byte is read or sent."""

    target: str | int = "actor"  # a role name (roles.py) or a ModelRole number
    mode: str | int = "full"  # "full", "partial", "lora" or an UpdateMode number
    lora: pb.LoraAdapter | None = None  # rank and alpha; given exactly when mode is "lora"
    # The data plane (transports.py): "auto" is shared memory on the server's host, else gRPC;
    # "dist" goes through the WeightsGroup given as group=.
    transport: str = AUTO
    streams: int | None = None  # parallel gRPC streams; None: one per 4 cores of this machine
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    timeout_s: float | None = None  # None: the client's deadline
    request_id: str | None = None  # sent as x-request-id call metadata
    crc32: bool = False  # a CRC-32 per chunk, which the server checks (update_file.py: why)
    sha256: bool = False  # the whole file's SHA-256 in the header (reads every tensor twice)
    allow_non_finite: bool = False  # let NaN and infinity through the server's value checks
    manifest: bool = True  # every tensor's name, dtype and shape in the header
    # "cuda_ipc" (or "auto" when it picks it): copy the tensors into one buffer on their GPU
    # first (client/weights/packing.py): one handle, which a server on that GPU checks and
    # applies in place, for one more copy of the weights on the trainer's GPU.
    pack: bool = False

    def __post_init__(self) -> None:
        # Counts must be ints: a float chunk_bytes failed in gRPC's sending thread (UNKNOWN
        # "Exception iterating requests!"), a float streams cut the file into a float number of
        # parts, a string failed a comparison; True passed as 1.
        for name, value in (("chunk_bytes", self.chunk_bytes), ("streams", self.streams)):
            if (value is not None or name == "chunk_bytes") and not _is_int(value):
                raise InvalidArgument(f"{name}: an int, got {value!r}")
        # A flag that is not a bool: "false" is truthy (crc32="false" turned CRC-32 on), and
        # allow_non_finite="false" failed in protobuf with a message naming no field.
        for name in ("crc32", "sha256", "allow_non_finite", "manifest", "pack"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"{name}: True or False, got {getattr(self, name)!r}")
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidArgument(
                f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], "
                f"got {self.chunk_bytes}"
            )
        if self.transport not in CLIENT_TRANSPORTS:
            raise InvalidArgument(
                f"transport: one of {', '.join(CLIENT_TRANSPORTS)}, got {self.transport!r}"
            )
        if self.pack and self.transport not in (AUTO, CUDA_IPC):
            raise InvalidArgument(
                f"pack: for transport 'cuda_ipc' (or 'auto'), not {self.transport!r}"
            )
        if self.streams is not None and not 1 <= self.streams <= MAX_STREAMS:
            raise InvalidArgument(f"streams: 1 to {MAX_STREAMS}, got {self.streams}")
        if (self.update_mode == pb.UPDATE_MODE_LORA) != (self.lora is not None):
            raise InvalidArgument("lora must be given exactly when mode is UPDATE_MODE_LORA")
        wire_role(self.target)

    @classmethod
    def of(cls, options: UpdateOptions | None = None, **fields: Any) -> UpdateOptions:
        """`options` with `fields` replaced (keyword names as the fields'); the defaults when
        `options` is None."""
        return _merged(cls, options, fields)

    @property
    def role(self) -> int:
        """The target as a wire ModelRole."""
        return wire_role(self.target)

    @property
    def update_mode(self) -> int:
        """The mode as a wire UpdateMode."""
        if isinstance(self.mode, str):
            try:
                return pb.UpdateMode.Value("UPDATE_MODE_" + self.mode.upper())
            except ValueError:
                raise InvalidArgument(f"mode: unknown name {self.mode!r}") from None
        if isinstance(self.mode, bool) or self.mode not in pb.UpdateMode.values():
            raise InvalidArgument(f"mode: unknown value {self.mode!r}")
        return int(self.mode)
