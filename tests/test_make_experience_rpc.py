"""MakeExperience over real gRPC against in-process servers on 127.0.0.1:0.

Two servers share one ModelSet loaded once for the module: `server` hosts every model (actor, a
differently seeded reference, critic, reward model) and a user reward function registered by
name; `bare` hosts the actor alone, for the refusals that need a missing model and for policy
versions (each server keeps its own versions, so updating `bare` leaves `server` at 0).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator

import grpc
import pytest
import torch
from helpers_server import serve_in_process
from rollserve.client.client import RolloutClient
from rollserve.client.protocol.errors import FailedPrecondition, InvalidArgument, RolloutError
from rollserve.client.protocol.experience import (
    Experience,
    concat_experiences,
    experience_from_proto,
)
from rollserve.client.protocol.requests import build_make_experience_request
from rollserve.server.config import ServerConfig
from rollserve.server.experience.maker import NaiveExperienceMaker
from rollserve.server.models import ModelSet, load_models
from rollserve.server.models.default_model import TinyModelSpec, save_tiny_causal_lm
from rollserve.server.serving.app import RolloutServer
from rollserve.v1 import rollout_pb2 as pb
from rollserve.v1 import rollout_pb2_grpc

# A user reward source (tests/test_maker.py: response length in characters), by name.
LENGTH_SOURCE = "length=tests.test_maker:length_reward"
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [40], [70, 71]]
GT = ["a", "b", "c", "d"]
GRPO = dict(
    samples_per_prompt=4,
    max_new_tokens=10,
    algorithm={"advantage_estimator": "group_norm"},
    rewards={"exact_match": 1.0, "length": 0.1},
    gt_answers=GT,
    return_texts=True,
)
PPO = dict(
    samples_per_prompt=1,
    max_new_tokens=10,
    algorithm={"advantage_estimator": "gae", "kl_coef": 0.05},
    rewards=["reward_model"],
    return_entropy=True,
    # openrlhf whitens gae advantages over the whole request: three generation batches.
    generate_batch_size=2,
    micro_batch_size=3,
)


@pytest.fixture(scope="module")
def models(tiny_actor_dir, tiny_critic_dir, tiny_reward_dir, tmp_path_factory) -> ModelSet:
    # A reference with other weights than the actor's, so KL terms are not zero.
    reference = save_tiny_causal_lm(tmp_path_factory.mktemp("ref"), TinyModelSpec(seed=1))
    config = ServerConfig(
        actor=str(tiny_actor_dir),
        reference=str(reference),
        critic=str(tiny_critic_dir),
        reward_model=str(tiny_reward_dir),
        device="cpu",
    )
    return load_models(config)


@pytest.fixture(scope="module")
def server(models: ModelSet) -> Iterator[RolloutServer]:
    server = serve_in_process(models, reward_fn=(LENGTH_SOURCE,), micro_batch_size=4)
    yield server
    server.stop(0)


@pytest.fixture(scope="module")
def bare(models: ModelSet) -> Iterator[RolloutServer]:
    actor_only = dataclasses.replace(models, reference=None, critic=None, reward=None)
    server = serve_in_process(actor_only)
    yield server
    server.stop(0)


@pytest.fixture(scope="module")
def client(server: RolloutServer) -> Iterator[RolloutClient]:
    with RolloutClient(server.address, timeout_s=60) as client:
        yield client


@pytest.fixture(scope="module")
def bare_client(bare: RolloutServer) -> Iterator[RolloutClient]:
    with RolloutClient(bare.address, timeout_s=60) as client:
        yield client


def _maker(server: RolloutServer) -> NaiveExperienceMaker:
    return server.runtime.maker


def _assert_identical(a: Experience, b: Experience) -> None:
    """Every tensor bit for bit, every info key, the texts."""
    for field in dataclasses.fields(Experience):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if field.name == "info":
            assert x.keys() == y.keys()
            for key in x:
                if key.startswith("time/"):  # wall-clock phase timings: no seed repeats them
                    continue
                assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), key
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), field.name
        else:
            assert x == y, field.name


# ---- determinism -----------------------------------------------------------------------------


@pytest.mark.parametrize("options", [GRPO, PPO], ids=["grpo", "ppo"])
def test_same_seed_gives_the_same_experience_in_process_over_grpc_and_streamed(
    server: RolloutServer, client: RolloutClient, options: dict
) -> None:
    local = _maker(server).make_experience(PROMPTS, seed=123, **options)
    remote = client.make_experience(PROMPTS, seed=123, **options)
    _assert_identical(local, remote)
    streamed = list(client.stream_experience(PROMPTS, seed=123, **options))
    assert len(streamed) > 1
    _assert_identical(local, concat_experiences(streamed))
    again = client.make_experience(PROMPTS, seed=123, **options)
    _assert_identical(remote, again)
    other = client.make_experience(PROMPTS, seed=124, **options)
    assert not torch.equal(other.sequences, remote.sequences)
    if options is PPO:
        assert remote.values is not None and remote.base_action_log_probs is not None
        assert remote.action_entropy is not None
        assert "reward/reward_model" in remote.info
    else:
        assert len(remote.response_texts) == 16
        assert {"reward/exact_match", "reward/length"} <= remote.info.keys()


def test_chat_text_prompts_over_grpc_equal_their_token_ids_in_process(
    server: RolloutServer, client: RolloutClient, models: ModelSet
) -> None:
    texts = ["hello there", "2+2="]
    ids = [
        list(
            models.tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for t in texts
    ]
    options = dict(GRPO, gt_answers=GT[:2], samples_per_prompt=2)
    remote = client.make_experience(texts, apply_chat_template=True, seed=5, **options)
    _assert_identical(_maker(server).make_experience(ids, seed=5, **options), remote)


# ---- the stream ------------------------------------------------------------------------------


def _responses(target: str, request: pb.MakeExperienceRequest) -> list[pb.MakeExperienceResponse]:
    with grpc.insecure_channel(target) as channel:
        return list(rollout_pb2_grpc.RolloutStub(channel).MakeExperience(request, timeout=60))


def test_micro_batches_stream_whole_groups_tight_and_numbered(server: RolloutServer) -> None:
    # 12 rows in groups of 3; micro-batches of 6 rows (5 rounded up to whole groups);
    # generation batches of 9 rows, so one micro-batch spans two generation batches.
    request = build_make_experience_request(
        PROMPTS,
        samples_per_prompt=3,
        max_new_tokens=10,
        seed=8,
        rewards=["length"],
        algorithm={"advantage_estimator": "group_norm"},  # streamed per generation batch
        micro_batch_size=5,
        generate_batch_size=9,
    )
    replies = _responses(server.address, request)
    assert [r.micro_batch_index for r in replies] == [0, 1]
    assert {r.num_micro_batches for r in replies} == {2}
    batches = [experience_from_proto(r.experience) for r in replies]
    assert [b.num_rows for b in batches] == [6, 6]
    for b in batches:
        counts = torch.bincount(b.prompt_index)
        assert set(counts[counts > 0].tolist()) == {3}
        assert b.attention_mask.any(0).all() and b.action_mask.any(0).all()
        assert (b.policy_version == 0).all()
    whole = concat_experiences(batches)
    assert torch.equal(whole.prompt_index, torch.arange(4).repeat_interleave(3))


def test_rows_carry_the_policy_version_and_min_policy_version_is_enforced(
    bare: RolloutServer, bare_client: RolloutClient, models: ModelSet
) -> None:
    options = dict(max_new_tokens=4, seed=1, rewards=["exact_match"], gt_answers=GT)
    options["algorithm"] = {"kl_coef": 0.0}  # the bare server has no reference
    base = bare_client.health().policy_version  # versions only move forward: read, not assume
    with pytest.raises(FailedPrecondition, match="min_policy_version"):
        bare_client.make_experience(PROMPTS, min_policy_version=base + 1, **options)
    # Re-send the actor's own weights as a later version: the version moves, the numbers do not.
    assert bare_client.update_weights(models.actor.module, version=base + 2).version == base + 2
    e = bare_client.make_experience(PROMPTS, min_policy_version=base + 2, **options)
    assert torch.equal(e.policy_version, torch.full((4,), base + 2))
    with pytest.raises(FailedPrecondition, match=f"min_policy_version: {base + 3}"):
        bare_client.make_experience(PROMPTS, min_policy_version=base + 3, **options)


# ---- refusals --------------------------------------------------------------------------------

# (options, the field the message must name); every one is INVALID_ARGUMENT.
BAD_REQUESTS = [
    (dict(prompts=[[5, 259]]), "prompts[0]"),  # the tiny vocabulary is 259 ids
    (dict(prompts=[[5, -1]]), "prompts[0]"),
    (dict(prompts=[[5], []]), "prompts.token_ids.lengths[1]"),
    (dict(prompts=[]), "prompts"),
    (dict(prompts=["ok", ""]), "prompts.texts[1]"),
    (dict(max_new_tokens=600), "sampling.max_new_tokens"),  # context is 512
    (dict(max_new_tokens=0), "sampling.max_new_tokens"),
    (dict(samples_per_prompt=0), "samples_per_prompt"),
    (dict(samples_per_prompt=-2), "samples_per_prompt"),
    (dict(temperature=-0.5), "sampling.temperature"),
    (dict(top_p=0.0), "sampling.top_p"),
    (dict(top_p=1.5), "sampling.top_p"),
    (dict(top_k=-1), "sampling.top_k"),
    (dict(preset="nope"), "algorithm.preset"),
    (dict(algorithm={"advantage_estimator": "nope"}), "algorithm.advantage_estimator"),
    (dict(algorithm={"advantage_estimator": "rloo"}), "samples_per_prompt"),  # n = 1
    (dict(rewards=["nope"]), "rewards"),
    (dict(gt_answers=["only one"]), "gt_answers"),
    (dict(rewards=["exact_match"], gt_answers=None), "gt_answers"),
]


def _bad(options: dict) -> dict:
    merged = dict(prompts=PROMPTS[:2], max_new_tokens=4, rewards=["exact_match"], gt_answers=GT[:2])
    merged.update(options)
    return merged


@pytest.mark.parametrize(("options", "field"), BAD_REQUESTS, ids=[f for _, f in BAD_REQUESTS])
def test_bad_input_is_invalid_argument_naming_the_field(
    client: RolloutClient, options: dict, field: str
) -> None:
    options = _bad(options)
    with pytest.raises(InvalidArgument) as caught:
        client.make_experience(options.pop("prompts"), **options)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.message


# (options, the field the message must name); the bare server lacks the model each one needs.
MISSING_MODELS = [
    (dict(algorithm={"advantage_estimator": "gae"}), "algorithm.advantage_estimator"),
    (dict(rewards=["reward_model"], algorithm={"kl_coef": 0.0}), "reward_model"),
    (dict(algorithm={"kl_coef": 0.1}), "algorithm.kl_coef"),
]


@pytest.mark.parametrize(("options", "field"), MISSING_MODELS, ids=["critic", "rm", "reference"])
def test_a_request_needing_a_missing_model_is_failed_precondition(
    bare_client: RolloutClient, options: dict, field: str
) -> None:
    options = _bad(options)
    with pytest.raises(FailedPrecondition) as caught:
        bare_client.make_experience(options.pop("prompts"), **options)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert field in caught.value.message


def test_refused_requests_leave_the_server_serving(
    client: RolloutClient, bare_client: RolloutClient
) -> None:
    for target, table in ((client, BAD_REQUESTS), (bare_client, MISSING_MODELS)):
        for options, _ in table:
            options = _bad(options)
            with pytest.raises(RolloutError):
                target.make_experience(options.pop("prompts"), timeout_s=30, **options)
        good = _bad({"algorithm": {"kl_coef": 0.0}})
        e = target.make_experience(good.pop("prompts"), timeout_s=30, **good)
        assert e.num_rows == 2
        health = target.health()
        assert health.serving and health.queue_depth == 0


# ---- presets and reward sources end to end ---------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "estimator"), [("coati", "gae"), ("openrlhf", "gae"), ("lightrft", "group_norm")]
)
def test_each_preset_runs_end_to_end(client: RolloutClient, preset: str, estimator: str) -> None:
    # No estimator named: each preset's own default with a critic loaded.
    e = client.make_experience(
        PROMPTS,
        samples_per_prompt=2,
        max_new_tokens=8,
        seed=3,
        preset=preset,
        rewards=["reward_model"],
    )
    assert e.num_rows == 8
    assert (e.values is not None) == (estimator == "gae")
    assert e.base_action_log_probs is not None  # every preset's kl_coef is 0.01
    for name in ("action_log_probs", "kl", "advantages", "returns", "reward"):
        assert torch.isfinite(getattr(e, name)).all(), name
    assert e.advantages[e.action_mask].abs().sum() > 0


def test_a_registered_user_reward_function_works_over_grpc(client: RolloutClient) -> None:
    e = client.make_experience(
        PROMPTS,
        samples_per_prompt=2,
        max_new_tokens=8,
        seed=4,
        rewards={"length": 2.0},
        return_texts=True,
    )
    lengths = [float(len(t)) for t in e.response_texts]
    assert e.info["reward/length"].tolist() == lengths
    assert torch.allclose(e.reward, 2.0 * e.info["reward/length"])


# ---- regressions: pad ids and policy versions across the two APIs ---------------------------


def test_a_pad_id_other_than_zero_survives_the_clients_concat(models: ModelSet) -> None:
    tokenizer = copy.deepcopy(models.tokenizer)
    tokenizer.pad_token = tokenizer.eos_token  # pad = eos = 2, as in many Llama checkpoints
    server = serve_in_process(dataclasses.replace(models, tokenizer=tokenizer))
    try:
        options = dict(GRPO, max_new_tokens=6, micro_batch_size=4, seed=1, rewards=["exact_match"])
        local = _maker(server).make_experience(PROMPTS, **options)
        with RolloutClient(server.address, timeout_s=60) as client:
            remote = client.make_experience(PROMPTS, **options)
        assert (local.sequences[~local.attention_mask] == 2).all()
        _assert_identical(local, remote)
    finally:
        server.stop(0)


def test_the_in_process_maker_follows_the_actors_policy_version(
    bare: RolloutServer, bare_client: RolloutClient, models: ModelSet
) -> None:
    version = bare_client.health().policy_version + 1
    bare_client.update_weights(models.actor.module, version=version)
    # The maker reads the version where the server holds it: its rows say so, and its gate opens.
    local = _maker(bare).make_experience(
        PROMPTS,
        max_new_tokens=2,
        rewards=["exact_match"],
        gt_answers=GT,
        algorithm={"kl_coef": 0.0},  # this server has no reference model
        min_policy_version=version,
    )
    assert local.policy_version.tolist() == [version] * len(PROMPTS)
