"""The experience maker in-process: generation -> scoring -> rewards -> shaping -> micro-batches.

Every check is an invariant against an independent recomputation with the real tiny models
(teacher-forced re-scoring, the reward model on the returned sequences, shape_experience over
the whole request), never stored numbers. One ModelSet (actor, a differently seeded reference,
critic, reward model) is loaded once for the module.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from rollserve.client.protocol.errors import FailedPrecondition, InvalidArgument
from rollserve.client.protocol.experience import Experience, concat_experiences
from rollserve.client.protocol.requests import build_make_experience_request
from rollserve.server.algorithms import resolve_algorithm, shape_experience
from rollserve.server.config import ServerConfig
from rollserve.server.experience.maker import NaiveExperienceMaker
from rollserve.server.experience.request import RequestDefaults
from rollserve.server.experience.rewards import RewardRegistry
from rollserve.server.experience.scoring import action_log_probs, reward_scores
from rollserve.server.models import ModelSet, load_models
from rollserve.server.models.default_model import TinyModelSpec, save_tiny_causal_lm
from rollserve.v1 import rollout_pb2 as pb

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [40], [70, 71]]


def length_reward(
    prompts: list[str], responses: list[str], gt_answers: list[str | None]
) -> list[float]:
    """A user reward source (registered by name): the response length in characters."""
    return [float(len(r)) for r in responses]


LENGTH_SOURCE = "length=tests.test_maker:length_reward"


@pytest.fixture(scope="session")
def tiny_reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A causal LM of the actor's shape with other weights, so KL terms are not zero."""
    return save_tiny_causal_lm(tmp_path_factory.mktemp("reference"), TinyModelSpec(seed=1))


@pytest.fixture(scope="module")
def models(tiny_actor_dir, tiny_reference_dir, tiny_critic_dir, tiny_reward_dir) -> ModelSet:
    config = ServerConfig(
        actor=str(tiny_actor_dir),
        reference=str(tiny_reference_dir),
        critic=str(tiny_critic_dir),
        reward_model=str(tiny_reward_dir),
        device="cpu",
    )
    return load_models(config)


@pytest.fixture(scope="module")
def maker(models: ModelSet) -> NaiveExperienceMaker:
    defaults = RequestDefaults(
        default_preset="openrlhf",
        max_new_tokens=12,
        generate_batch_size=64,
        forward_batch_size=16,
        micro_batch_size=16,
        max_request_rows=4096,
    )
    return NaiveExperienceMaker(models, RewardRegistry.from_specs([LENGTH_SOURCE]), defaults)


def _rescore(model: torch.nn.Module, e: Experience, temperature: float | None = None):
    """Teacher-forced log-probs and entropy (B, A) of e's own sequences."""
    return action_log_probs(
        model,
        e.sequences,
        e.attention_mask,
        e.num_actions,
        forward_batch_size=64,
        temperature=temperature,
        with_entropy=True,
    )


def _masked_close(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> bool:
    return torch.allclose(a[mask], b[mask], atol=2e-5, rtol=1e-5)


# ---- log-probs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "flag", "divides"),
    [
        ("openrlhf", None, True),  # OpenRLHF's convention: logits / temperature
        ("coati", None, False),  # ColossalChat: raw logits
        ("openrlhf", False, False),
        ("coati", True, True),
    ],
)
def test_log_probs_equal_teacher_forced_rescoring_with_the_temperature_convention(
    maker: NaiveExperienceMaker, models: ModelSet, preset: str, flag: bool | None, divides: bool
) -> None:
    temperature = 0.7
    e = maker.make_experience(
        PROMPTS,
        samples_per_prompt=2,
        temperature=temperature,
        logprobs_use_temperature=flag,
        seed=11,
        preset=preset,
        algorithm={"kl_coef": 0.05},
        rewards=["length"],
        return_entropy=True,
    )
    mask = e.action_mask
    used, other = (temperature, None) if divides else (None, temperature)
    actor, entropy = _rescore(models.actor.module, e, used)
    assert _masked_close(e.action_log_probs, actor, mask)
    assert _masked_close(e.action_entropy, entropy, mask)
    assert not _masked_close(e.action_log_probs, _rescore(models.actor.module, e, other)[0], mask)
    reference, _ = _rescore(models.reference.module, e, used)
    assert _masked_close(e.base_action_log_probs, reference, mask)
    # The reference has other weights: a real KL term, not a copy of the actor.
    assert not _masked_close(e.base_action_log_probs, e.action_log_probs, mask)
    assert float(e.info["kl"].abs().max()) > 0


def test_lengths_are_reported_per_row(maker: NaiveExperienceMaker) -> None:
    e = maker.make_experience(PROMPTS, samples_per_prompt=2, seed=3, rewards=["length"])
    assert torch.equal(e.info["response_length"], e.action_mask.sum(-1))
    assert torch.equal(e.info["total_length"], e.attention_mask.sum(-1))
    prompt_lengths = torch.tensor([len(p) for p in PROMPTS]).repeat_interleave(2)
    assert torch.equal(e.info["total_length"] - e.info["response_length"], prompt_lengths)
    assert torch.equal(e.prompt_index, torch.arange(4).repeat_interleave(2))


# ---- stopping --------------------------------------------------------------------------------


def test_rows_without_a_stop_are_flagged_truncated(maker: NaiveExperienceMaker) -> None:
    e = maker.make_experience(
        PROMPTS, max_new_tokens=6, ignore_eos=True, seed=1, rewards=["length"]
    )
    assert e.info["truncated"].all()
    assert e.action_mask.all() and e.num_actions == 6
    assert torch.equal(e.info["response_length"], torch.full((4,), 6))


def test_a_stop_sequence_ends_the_action_mask_inclusive(maker: NaiveExperienceMaker) -> None:
    greedy = dict(max_new_tokens=10, temperature=0.0, ignore_eos=True, rewards=["length"])
    free = maker.make_experience(PROMPTS, seed=0, **greedy)
    response = free.sequences[0, free.prompt_width :].tolist()
    # A two-token stop sequence taken from row 0's own greedy response, ending at column 4.
    stop = response[3:5]
    first_end = next(j for j in range(1, 10) if response[j - 1 : j + 1] == stop)
    stopped = maker.make_experience(PROMPTS, seed=0, stop_sequences=[stop], **greedy)
    length = int(stopped.info["response_length"][0])
    assert length == first_end + 1  # the stop sequence itself is part of the action mask
    assert stopped.action_mask[0, :length].all() and not stopped.action_mask[0, length:].any()
    row = stopped.sequences[0, stopped.prompt_width :]
    assert row[length - 2 : length].tolist() == stop
    assert not bool(stopped.info["truncated"][0])
    for r in range(1, 4):  # other rows: truncated exactly when they never produced the stop
        hit = not bool(stopped.info["truncated"][r])
        tokens = stopped.sequences[r, stopped.prompt_width :][stopped.action_mask[r]].tolist()
        assert hit == (tokens[-2:] == stop)


# ---- rewards ---------------------------------------------------------------------------------


def test_reward_is_the_weighted_sum_of_the_recipe(
    maker: NaiveExperienceMaker, models: ModelSet
) -> None:
    e = maker.make_experience(
        PROMPTS,
        samples_per_prompt=2,
        seed=5,
        preset="openrlhf",  # stores the recipe's reward as is (no overlong or sequence KL)
        rewards={"reward_model": 0.5, "length": 0.25},
        return_texts=True,
    )
    lengths = torch.tensor([float(len(t)) for t in e.response_texts])
    assert torch.equal(e.info["reward/length"], lengths)
    rm = reward_scores(models.reward.module, e.sequences, e.attention_mask, forward_batch_size=64)
    assert torch.allclose(e.info["reward/reward_model"], rm, atol=1e-5)
    expected = 0.5 * e.info["reward/reward_model"] + 0.25 * e.info["reward/length"]
    assert torch.allclose(e.reward, expected, atol=1e-6)
    assert float(lengths.std()) > 0  # the recipe really varies across rows


def test_user_reward_function_from_specs_sees_decoded_responses(models: ModelSet) -> None:
    seen: list[tuple[list[str], list[str], list[str | None]]] = []

    def recording(prompts, responses, gt_answers):
        seen.append((prompts, responses, gt_answers))
        return [1.0] * len(responses)

    registry = RewardRegistry.from_specs([LENGTH_SOURCE])
    registry = dataclasses.replace(registry, sources={**registry.sources, "rec": recording})
    maker = NaiveExperienceMaker(models, registry, RequestDefaults("openrlhf", 8, 64, 16, 16, 4096))
    e = maker.make_experience(
        ["ab", "c"], gt_answers=["x", "y"], seed=2, rewards=["rec", "length"], return_texts=True
    )
    (prompts, responses, gt_answers) = seen[0]
    assert prompts == ["ab", "c"] and gt_answers == ["x", "y"]
    assert tuple(responses) == e.response_texts
    assert e.info["reward/length"].tolist() == [float(len(t)) for t in responses]


def test_texts_decoded_in_the_background_are_the_same_and_a_failure_reaches_the_request(
    models: ModelSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a GPU the response texts are decoded on a thread of their own while the device scores
    # the rows (forced here on the CPU): the same texts, rewards and tensors, the decoding off
    # the maker's thread, and a tokenizer error still fails the request.
    import threading

    from rollserve.server.experience import steps

    defaults = RequestDefaults("openrlhf", 8, 1, 16, 16, 4096)  # two generation batches
    request = dict(gt_answers=["x", "y"], seed=2, rewards=["length"], return_texts=True)
    inline = NaiveExperienceMaker(models, RewardRegistry.from_specs([LENGTH_SOURCE]), defaults)
    assert not inline.decode_in_background  # the CPU's default
    want = inline.make_experience(["ab", "c"], **request)
    background = NaiveExperienceMaker(models, RewardRegistry.from_specs([LENGTH_SOURCE]), defaults)
    background.decode_in_background = True
    threads: list[str] = []
    decode = steps.decode_responses

    def spy(*args):
        threads.append(threading.current_thread().name)
        return decode(*args)

    monkeypatch.setattr("rollserve.server.experience.maker.decode_responses", spy)
    got = background.make_experience(["ab", "c"], **request)
    assert threads == ["rollserve-decode"] * 2  # one per generation batch, never inline
    assert got.response_texts == want.response_texts
    assert torch.equal(got.info["reward/length"], want.info["reward/length"])
    _same(got, want)

    def broken(*args):
        raise RuntimeError("tokenizer broke")

    monkeypatch.setattr("rollserve.server.experience.maker.decode_responses", broken)
    with pytest.raises(RuntimeError, match="tokenizer broke"):
        background.make_experience(["ab", "c"], **request)


# ---- prompts ---------------------------------------------------------------------------------


def _same(a: Experience, b: Experience) -> None:
    for name in ("sequences", "attention_mask", "action_mask", "action_log_probs", "advantages"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("chat", [False, True])
def test_text_prompts_equal_their_token_ids(
    maker: NaiveExperienceMaker, models: ModelSet, chat: bool
) -> None:
    texts = ["hello there", "2+2="]
    tokenizer = models.tokenizer
    if chat:
        ids = [
            list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True
                )["input_ids"]
            )
            for t in texts
        ]
        assert all(len(i) > len(t) for i, t in zip(ids, texts, strict=True))  # template added
    else:
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    options = dict(samples_per_prompt=2, seed=9, rewards=["length"])
    from_text = maker.make_experience(texts, apply_chat_template=chat, **options)
    from_ids = maker.make_experience(ids, **options)
    _same(from_text, from_ids)


# ---- micro-batches ---------------------------------------------------------------------------


def _micro_batches(maker: NaiveExperienceMaker, **options) -> list[Experience]:
    spec = maker.decode(build_make_experience_request(PROMPTS, **options))
    batches = list(maker.iter_experience(spec, policy_version=7))
    assert len(batches) == spec.num_micro_batches
    return batches


def test_micro_batches_have_the_requested_rows_whole_groups_and_tight_widths(
    maker: NaiveExperienceMaker,
) -> None:
    # 4 prompts x 3 = 12 rows; micro-batches of 5 -> 6 rows; generation batches of 9 rows, so
    # the second micro-batch spans both generation batches.
    # group_norm is not whitened: each generation batch is shaped and streamed on its own.
    options = dict(
        samples_per_prompt=3,
        seed=4,
        rewards=["length"],
        algorithm={"advantage_estimator": "group_norm"},
        generate_batch_size=9,
    )
    batches = _micro_batches(maker, micro_batch_size=5, **options)
    assert [b.num_rows for b in batches] == [6, 6]
    for b in batches:
        counts = torch.bincount(b.prompt_index)
        assert set(counts[counts > 0].tolist()) == {3}  # whole groups only
        assert b.attention_mask.any(0).all()  # no column is padding in every row
        assert b.action_mask.any(0).all()
        assert b.prompt_width == int((b.attention_mask.sum(-1) - b.action_mask.sum(-1)).max())
        assert (b.policy_version == 7).all()
    whole = concat_experiences(batches)
    assert torch.equal(whole.prompt_index, torch.arange(4).repeat_interleave(3))
    # The cut does not change the rows: other micro-batch sizes concatenate to the same.
    for rows in (3, 12):
        other = concat_experiences(_micro_batches(maker, micro_batch_size=rows, **options))
        _same(whole, other)
        assert torch.equal(whole.reward, other.reward)


def test_whitening_spans_every_generation_batch_of_the_request(
    maker: NaiveExperienceMaker,
) -> None:
    # openrlhf + reinforce whitens globally; 4 generation batches of one group each.
    options = dict(
        samples_per_prompt=2,
        seed=6,
        preset="openrlhf",
        algorithm={"advantage_estimator": "reinforce"},
        rewards=["length"],
        generate_batch_size=2,
        micro_batch_size=2,
    )
    batches = _micro_batches(maker, **options)
    assert len(batches) == 4
    e = concat_experiences(batches)
    valid = e.advantages[e.action_mask].double()
    assert abs(float(valid.mean())) < 1e-4  # float32 statistics
    assert abs(float(valid.var(unbiased=False)) - 1) < 1e-3
    # The same shaping over all rows at once (whitening per generation batch would differ).
    cfg = resolve_algorithm(
        pb.AlgorithmOptions(preset="openrlhf", advantage_estimator="reinforce"),
        default_preset="openrlhf",
        has_critic=True,
    )
    expected = shape_experience(
        cfg,
        action_log_probs=e.action_log_probs,
        base_action_log_probs=e.base_action_log_probs,
        action_mask=e.action_mask,
        values=None,
        rewards=e.reward,
        group_size=2,
        max_new_tokens=12,
    )
    assert _masked_close(e.advantages, expected.advantages, e.action_mask)
    per_batch = [float(b.advantages[b.action_mask].mean()) for b in batches]
    assert max(abs(m) for m in per_batch) > 1e-3  # batches are not whitened one by one


# ---- refusals --------------------------------------------------------------------------------


def test_in_process_min_policy_version_above_the_makers_is_refused(
    maker: NaiveExperienceMaker,
) -> None:
    with pytest.raises(FailedPrecondition, match="min_policy_version"):
        maker.make_experience(PROMPTS, rewards=["length"], min_policy_version=1)


def test_rloo_with_one_sample_is_refused_before_generation(maker: NaiveExperienceMaker) -> None:
    request = build_make_experience_request(
        PROMPTS, rewards=["length"], algorithm={"advantage_estimator": "rloo"}
    )
    with pytest.raises(InvalidArgument, match="samples_per_prompt"):
        maker.decode(request)


# ---- prefix sharing ----------------------------------------------------------------------------


def test_sharing_the_prefill_of_a_group_leaves_the_experience_unchanged(
    maker: NaiveExperienceMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    import functools

    from rollserve.server.experience import generation, steps

    options = dict(
        samples_per_prompt=4, seed=21, temperature=0.9, top_k=40, rewards=["length"],
        return_entropy=True, return_texts=True,
        algorithm={"advantage_estimator": "group_norm", "kl_coef": 0.05},
    )  # fmt: skip
    shared = maker.make_experience(PROMPTS, **options)
    every_row = functools.partial(generation.generate, share_prefill=False)
    monkeypatch.setattr(steps, "generate", every_row)
    unshared = maker.make_experience(PROMPTS, **options)
    _same(shared, unshared)
    assert shared.response_texts == unshared.response_texts
    for name in ("base_action_log_probs", "reward", "kl", "returns", "action_entropy"):
        assert torch.equal(getattr(shared, name), getattr(unshared, name)), name
