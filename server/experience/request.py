"""Decode and validate a MakeExperienceRequest into an ExperienceSpec (plain, resolved values).

This runs before anything is queued (in the gRPC handler thread, or the rollout loop): a bad
request is refused with INVALID_ARGUMENT naming the field (or FAILED_PRECONDITION when the
server lacks a model the request needs) and never reaches the engine. Each field is read,
defaulted and checked here and nowhere else, against the server's limits (RequestDefaults);
the prompt count is checked before any prompt is tokenized. A request over a limit is
INVALID_ARGUMENT, not RESOURCE_EXHAUSTED: that code means "the server is busy, back off and
retry" (the engine's queue), while a request over a fixed limit fails the same way on every retry.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ...client.protocol.errors import FailedPrecondition, InvalidArgument
from ...client.protocol.reward_moments import RunningRewardMoments
from ...v1 import rollout_pb2 as pb
from ..algorithms import AlgorithmConfig, min_group_size, resolve_algorithm
from ..config import ServerConfig
from ..models import ModelSet
from .generation import SamplingParams
from .rewards import BUILTIN_RULES, REWARD_MODEL_SOURCE, RewardRegistry

__all__ = [
    "ExperienceSpec",
    "RequestDefaults",
    "decode_experience_request",
    "requested_samples",
]

_SEED_BITS = 63
# Built-in rules compare with gt_answer; user sources decide for themselves.
_NEEDS_GT = frozenset(BUILTIN_RULES)


@dataclass(frozen=True)
class RequestDefaults:
    """Server-side defaults and limits a request falls back on (from ServerConfig)."""

    default_preset: str
    max_new_tokens: int
    generate_batch_size: int
    forward_batch_size: int
    micro_batch_size: int
    max_request_rows: int
    # Token budgets (ServerConfig.max_request_tokens / max_batch_tokens): each count alone can be
    # legal while their product is not (4096 prompts x 4096 new tokens in one generation batch).
    max_request_tokens: int = 16_777_216
    max_batch_tokens: int = 262_144
    # The most a request may ask for (--max-prompts, --max-samples-per-prompt,
    # --max-new-tokens-limit).
    max_prompts: int = 4096
    max_samples_per_prompt: int = 256
    max_new_tokens_limit: int = 4096

    @classmethod
    def from_config(cls, config: ServerConfig, *, default_preset: str) -> RequestDefaults:
        # Every field but the preset is the ServerConfig field of the same name.
        names = [field.name for field in dataclasses.fields(cls) if field.name != "default_preset"]
        return cls(default_preset=default_preset, **{name: getattr(config, name) for name in names})


@dataclass(frozen=True)
class ExperienceSpec:
    """A validated request: everything the experience maker needs, resolved."""

    prompts: tuple[tuple[int, ...], ...]  # token ids per prompt
    gt_answers: tuple[str | None, ...]  # one per prompt
    samples_per_prompt: int  # n: rows per group
    sampling: SamplingParams
    seed: int
    algorithm: AlgorithmConfig
    rewards: tuple[tuple[str, float], ...]  # (source, weight)
    generate_batch_rows: int  # multiples of n, so a group is never split
    forward_batch_rows: int
    micro_batch_rows: int
    return_entropy: bool
    return_texts: bool
    min_policy_version: int
    request_id: str
    # LightRFT's running reward moments before this request (algorithm.reward_running_norm);
    # None: no history, or the normalisation is off.
    reward_moments: RunningRewardMoments | None = None

    @property
    def num_rows(self) -> int:
        return len(self.prompts) * self.samples_per_prompt

    @property
    def num_micro_batches(self) -> int:
        return math.ceil(self.num_rows / self.micro_batch_rows)


def decode_experience_request(
    request: pb.MakeExperienceRequest,
    *,
    models: ModelSet,
    rewards: RewardRegistry,
    defaults: RequestDefaults,
    tokenizer_lock: threading.Lock | None = None,
) -> ExperienceSpec:
    """Validate `request` against the loaded models and the server's limits."""
    lock = tokenizer_lock or threading.Lock()
    prompts = _prompts(request, models, defaults, lock)
    gt_answers = _gt_answers(request, len(prompts))
    algorithm = resolve_algorithm(
        request.algorithm,
        default_preset=defaults.default_preset,
        has_critic=models.critic is not None,
    )
    sampling = _sampling(request.sampling, algorithm, models, defaults, lock)
    row_tokens = max(len(p) for p in prompts) + sampling.max_new_tokens  # one padded row
    # Before anything runs: rloo with n = 1 would otherwise fail only after the device has
    # generated and scored the whole first batch.
    n = _samples_per_prompt(request, algorithm, len(prompts), row_tokens, defaults)
    if algorithm.needs_reference and models.reference is None:
        raise FailedPrecondition("algorithm.kl_coef: > 0 needs a reference model")
    if algorithm.action_mask_rule == "process_sequences" and models.tokenizer.eos_token_id is None:
        raise FailedPrecondition(
            "algorithm.action_mask_rule: 'process_sequences' needs an eos_token_id and this "
            "server's tokenizer has none"
        )
    _check_context(prompts, sampling.max_new_tokens, models.max_context_tokens)
    _check_request_tokens(len(prompts) * n, row_tokens, defaults.max_request_tokens)
    return ExperienceSpec(
        prompts=prompts,
        gt_answers=gt_answers,
        samples_per_prompt=n,
        sampling=sampling,
        seed=request.sampling.seed
        if request.sampling.HasField("seed")
        else secrets.randbits(_SEED_BITS),
        algorithm=algorithm,
        rewards=_reward_recipe(request, rewards, models, any(a is not None for a in gt_answers)),
        generate_batch_rows=_batch_rows("generate_batch_size", request, defaults, n, row_tokens),
        forward_batch_rows=_batch_rows("forward_batch_size", request, defaults, 1, row_tokens),
        micro_batch_rows=_rows("micro_batch_size", request, defaults, n),
        return_entropy=request.outputs.action_entropy,
        return_texts=request.outputs.response_texts,
        min_policy_version=request.min_policy_version,
        request_id=request.request_id,
        reward_moments=_reward_moments(request.algorithm, algorithm),
    )


def _prompts(
    request: pb.MakeExperienceRequest,
    models: ModelSet,
    defaults: RequestDefaults,
    lock: threading.Lock,
) -> tuple[tuple[int, ...], ...]:
    kind = request.WhichOneof("prompts")
    if kind == "token_ids":
        _check_at_most("prompts", len(request.token_ids.lengths), defaults.max_prompts)
        prompts = _ragged(request.token_ids)
    elif kind == "texts":
        _check_at_most("prompts", len(request.texts.texts), defaults.max_prompts)
        prompts = _tokenize_texts(request.texts, models.tokenizer, lock)
    else:
        raise InvalidArgument("prompts: set token_ids or texts")
    if not prompts:
        raise InvalidArgument("prompts: at least one prompt is required")
    vocab = models.vocab_size
    for i, ids in enumerate(prompts):
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(
                f"prompts[{i}]: token id {bad} is outside the vocabulary [0, {vocab})"
            )
    return prompts


# The flag behind each request limit, named in the refusal.
_LIMIT_FLAGS = {
    "prompts": "--max-prompts",
    "samples_per_prompt": "--max-samples-per-prompt",
    "sampling.max_new_tokens": "--max-new-tokens-limit",
}


def _check_at_most(field: str, value: int, limit: int) -> None:
    if value > limit:
        raise InvalidArgument(
            f"{field}: {value} is over this server's limit of {limit} ({_LIMIT_FLAGS[field]})"
        )


def requested_samples(request: pb.MakeExperienceRequest) -> int:
    """samples_per_prompt as the request asks, 1 when unset (unchecked: the decoder checks it)."""
    return request.samples_per_prompt if request.HasField("samples_per_prompt") else 1


def _samples_per_prompt(
    request: pb.MakeExperienceRequest,
    algorithm: AlgorithmConfig,
    num_prompts: int,
    row_tokens: int,
    defaults: RequestDefaults,
) -> int:
    """n, the rows of one group: unset is 1; within the server's limits and the estimator's
    needs, and one group must fit a generation batch (--max-batch-tokens)."""
    n = requested_samples(request)
    if n < 1:
        raise InvalidArgument(f"samples_per_prompt: must be >= 1, got {n}")
    _check_at_most("samples_per_prompt", n, defaults.max_samples_per_prompt)
    if num_prompts * n > defaults.max_request_rows:
        raise InvalidArgument(
            f"samples_per_prompt: {num_prompts} prompts x {n} samples = {num_prompts * n} "
            f"rows is over this server's limit of {defaults.max_request_rows}"
        )
    least = min_group_size(algorithm.estimator)
    if n < least:
        raise InvalidArgument(
            f"samples_per_prompt: advantage_estimator {algorithm.estimator!r} needs >= {least} "
            f"samples per prompt, got {n}"
        )
    if n * row_tokens > defaults.max_batch_tokens:
        raise InvalidArgument(
            f"samples_per_prompt: one group of {n} rows x {row_tokens} tokens is over this "
            f"server's limit of {defaults.max_batch_tokens} tokens per batch (--max-batch-tokens)"
        )
    return n


def _ragged(ragged: pb.RaggedTokenIds) -> tuple[tuple[int, ...], ...]:
    values, lengths = list(ragged.values), list(ragged.lengths)
    if sum(max(n, 0) for n in lengths) != len(values):
        raise InvalidArgument(
            f"prompts.token_ids: lengths sum to {sum(lengths)} but there are {len(values)} values"
        )
    prompts, start = [], 0
    for i, length in enumerate(lengths):
        if length < 1:
            raise InvalidArgument(f"prompts.token_ids.lengths[{i}]: empty prompt")
        prompts.append(tuple(values[start : start + length]))
        start += length
    return tuple(prompts)


def _tokenize_texts(
    texts: pb.TextPrompts, tokenizer, lock: threading.Lock
) -> tuple[tuple[int, ...], ...]:
    if texts.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise FailedPrecondition("prompts.texts.apply_chat_template: the tokenizer has no template")
    prompts = []
    with lock:  # HF fast tokenizers are not safe to share between threads
        for i, text in enumerate(texts.texts):
            if not text:
                raise InvalidArgument(f"prompts.texts[{i}]: empty prompt")
            if texts.apply_chat_template:
                ids = tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
                )
                ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            else:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if not ids:
                raise InvalidArgument(f"prompts.texts[{i}]: tokenizes to no tokens")
            prompts.append(tuple(int(t) for t in ids))
    return tuple(prompts)


def _gt_answers(request: pb.MakeExperienceRequest, num_prompts: int) -> tuple[str | None, ...]:
    if not request.gt_answers:
        return (None,) * num_prompts
    if len(request.gt_answers) != num_prompts:
        raise InvalidArgument(
            f"gt_answers: {len(request.gt_answers)} answers for {num_prompts} prompts; "
            "give none or one per prompt"
        )
    return tuple(request.gt_answers)


def _sampling(
    options: pb.SamplingOptions,
    algorithm: AlgorithmConfig,
    models: ModelSet,
    defaults: RequestDefaults,
    lock: threading.Lock,
) -> SamplingParams:
    def get(name: str, default: float | int | bool) -> float | int | bool:
        return getattr(options, name) if options.HasField(name) else default

    tokenizer = models.tokenizer
    stops = [tuple(s.token_ids) for s in options.stop_sequences]
    with lock:
        for text in options.stop_strings:
            stops.append(tuple(tokenizer(text, add_special_tokens=False)["input_ids"]))
    if not options.ignore_eos and tokenizer.eos_token_id is not None:
        stops.append((int(tokenizer.eos_token_id),))
    for i, stop in enumerate(stops):
        if not stop or not all(0 <= t < models.vocab_size for t in stop):
            raise InvalidArgument(
                f"sampling.stop_sequences[{i}]: needs >= 1 token id in [0, {models.vocab_size})"
            )
    max_new_tokens = get("max_new_tokens", defaults.max_new_tokens)
    _check_at_most("sampling.max_new_tokens", max_new_tokens, defaults.max_new_tokens_limit)
    try:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=get("min_new_tokens", 0),
            temperature=get("temperature", 1.0),
            top_k=get("top_k", 0),
            top_p=get("top_p", 1.0),
            stop_sequences=tuple(dict.fromkeys(stops)),  # de-duplicated, order kept
            # Unset: the preset's convention (OpenRLHF divides by temperature).
            logprobs_use_temperature=get(
                "logprobs_use_temperature", algorithm.logprobs_use_temperature
            ),
        )
    except InvalidArgument as error:
        raise InvalidArgument(f"sampling.{error.message}") from None


def _check_context(prompts: Sequence[Sequence[int]], max_new_tokens: int, context: int) -> None:
    longest = max(len(p) for p in prompts)
    if context and longest + max_new_tokens > context:
        raise InvalidArgument(
            f"sampling.max_new_tokens: the longest prompt ({longest} tokens) plus "
            f"max_new_tokens ({max_new_tokens}) exceeds the model's context of {context} tokens"
        )


def _reward_recipe(
    request: pb.MakeExperienceRequest, registry: RewardRegistry, models: ModelSet, has_gt: bool
) -> tuple[tuple[str, float], ...]:
    has_rm = models.reward is not None
    if not request.rewards:
        if not has_rm:
            raise InvalidArgument(
                f"rewards: empty recipe and no reward model loaded; name sources from "
                f"{registry.offered(has_reward_model=False)}"
            )
        return ((REWARD_MODEL_SOURCE, 1.0),)
    recipe = []
    for i, term in enumerate(request.rewards):
        registry.check(term.source, has_reward_model=has_rm)
        weight = term.weight if term.HasField("weight") else 1.0
        if not math.isfinite(weight):
            raise InvalidArgument(f"rewards[{i}].weight: must be finite, got {weight}")
        if term.source in _NEEDS_GT and not has_gt:
            raise InvalidArgument(f"gt_answers: required by reward source {term.source!r}")
        recipe.append((term.source, weight))
    return tuple(recipe)


def _reward_moments(
    options: pb.AlgorithmOptions, algorithm: AlgorithmConfig
) -> RunningRewardMoments | None:
    """The running moments the trainer sends back (rollout.proto: RewardMoments): finite,
    count >= 0, and var > 0 once count is; only with reward_running_norm on."""
    if not options.HasField("reward_moments"):
        return None
    if not algorithm.uses_running_norm:
        raise InvalidArgument(
            "algorithm.reward_moments: set, but reward_running_norm is off; send the moments "
            "only with reward_running_norm 'scale' or 'standardize'"
        )
    moments = options.reward_moments
    try:
        return RunningRewardMoments.from_proto(moments)
    except InvalidArgument as error:
        raise InvalidArgument(f"algorithm.{error.message}") from None


def _rows(
    name: str, request: pb.MakeExperienceRequest, defaults: RequestDefaults, group: int
) -> int:
    requested = getattr(request.batching, name)
    if requested < 0:
        raise InvalidArgument(f"batching.{name}: must be >= 0, got {requested}")
    rows = requested or getattr(defaults, name)
    return math.ceil(rows / group) * group  # whole groups


def _check_request_tokens(rows: int, row_tokens: int, limit: int) -> None:
    # What the response holds and the device must make: every legal count multiplied together
    # (prompts x samples x (prompt + new tokens)) can be far beyond memory.
    if rows * row_tokens > limit:
        raise InvalidArgument(
            f"sampling.max_new_tokens: {rows} rows x {row_tokens} tokens (longest prompt + "
            f"max_new_tokens) = {rows * row_tokens} tokens is over this server's limit of "
            f"{limit} (--max-request-tokens)"
        )


def _batch_rows(
    name: str, request: pb.MakeExperienceRequest, defaults: RequestDefaults, group: int,
    row_tokens: int,
) -> int:  # fmt: skip
    """Rows per generation or scoring batch, within --max-batch-tokens (whole groups).

    The device memory of one batch grows with rows x row_tokens (KV cache, logits): a size the
    request asks for beyond the budget is refused; the server's default is lowered to fit.
    """
    rows = _rows(name, request, defaults, group)
    if rows * row_tokens <= defaults.max_batch_tokens:
        return rows
    if getattr(request.batching, name):
        raise InvalidArgument(
            f"batching.{name}: {rows} rows x {row_tokens} tokens = {rows * row_tokens} tokens "
            f"is over this server's limit of {defaults.max_batch_tokens} (--max-batch-tokens)"
        )
    # At least one group: _samples_per_prompt checked that a group fits the budget.
    return defaults.max_batch_tokens // row_tokens // group * group
