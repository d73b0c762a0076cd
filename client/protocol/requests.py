"""Build MakeExperienceRequest messages from plain Python arguments.

The gRPC client and the server's in-process maker both go through this function, so the same
arguments mean the same request whether the experience is made locally or remotely.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...v1 import rollout_pb2 as pb

__all__ = ["build_make_experience_request", "Prompts", "RewardRecipe"]

# Token-id prompts (one list of ids per prompt) or text prompts.
Prompts = Sequence[Sequence[int]] | Sequence[str]
# {"exact_match": 1.0, "reward_model": 0.5} or ["exact_match"] (weight 1 each).
RewardRecipe = Mapping[str, float] | Sequence[str]

_ALGORITHM_FIELDS = frozenset(pb.AlgorithmOptions.DESCRIPTOR.fields_by_name)


def _set_prompts(request: pb.MakeExperienceRequest, prompts: Prompts, chat: bool) -> None:
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
    for ids in prompts:
        ids = [int(i) for i in ids]
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


def _set_optional(message, **fields: object) -> None:
    """Set the fields whose value is not None (proto3 `optional` keeps "unset" distinct)."""
    for name, value in fields.items():
        if value is not None:
            setattr(message, name, value)


# Over 60 lines only through its signature: one keyword per request field, flat on purpose so
# that RolloutClient.make_experience can forward them unchanged.
def build_make_experience_request(
    prompts: Prompts,
    *,
    gt_answers: Sequence[str] | None = None,
    samples_per_prompt: int | None = None,
    max_new_tokens: int | None = None,
    min_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
    stop_strings: Sequence[str] = (),
    seed: int | None = None,
    ignore_eos: bool = False,
    logprobs_use_temperature: bool | None = None,
    apply_chat_template: bool = False,
    preset: str | None = None,
    algorithm: Mapping[str, object] | None = None,
    rewards: RewardRecipe | None = None,
    micro_batch_size: int = 0,
    generate_batch_size: int = 0,
    forward_batch_size: int = 0,
    return_entropy: bool = False,
    return_texts: bool = False,
    min_policy_version: int = 0,
    request_id: str = "",
) -> pb.MakeExperienceRequest:
    """One MakeExperienceRequest. `algorithm` maps AlgorithmOptions field names to values
    (e.g. {"advantage_estimator": "group_norm", "kl_coef": 0.0}); None means the preset's."""
    request = pb.MakeExperienceRequest(min_policy_version=min_policy_version, request_id=request_id)
    _set_prompts(request, prompts, apply_chat_template)
    if gt_answers is not None:
        request.gt_answers.extend(gt_answers)
    _set_optional(request, samples_per_prompt=samples_per_prompt)
    sampling = request.sampling
    _set_optional(
        sampling,
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        logprobs_use_temperature=logprobs_use_temperature,
    )
    for sequence in stop_sequences:
        sampling.stop_sequences.add(token_ids=[int(t) for t in sequence])
    sampling.stop_strings.extend(stop_strings)
    sampling.ignore_eos = ignore_eos
    options = dict(algorithm or {})
    unknown = set(options) - _ALGORITHM_FIELDS
    if unknown:
        raise TypeError(f"unknown algorithm options {sorted(unknown)}; see AlgorithmOptions")
    _set_optional(request.algorithm, preset=preset, **options)
    _set_rewards(request, rewards)
    request.batching.micro_batch_size = micro_batch_size
    request.batching.generate_batch_size = generate_batch_size
    request.batching.forward_batch_size = forward_batch_size
    request.outputs.action_entropy = return_entropy
    request.outputs.response_texts = return_texts
    return request
