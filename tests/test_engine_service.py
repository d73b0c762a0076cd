"""The generation engine wired into the service, over real gRPC on 127.0.0.1:0 (tiny models, CPU).

Behaviour log-probs (Experience.rollout_log_probs) next to the re-scored action_log_probs, and
their wire compatibility with clients and servers that predate the field; the phase timings in
info["time/..."] and in the metrics; the generation path and KV capacity in Health, set by the
server's flags; the engine's warm-up before SERVING (the engine path forced on the CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from helpers_server import serve_in_process
from rollserve.client.client import RolloutClient
from rollserve.client.protocol.experience import (
    Experience,
    concat_experiences,
    experience_from_proto,
    experience_to_proto,
    make_experience_batch,
    split_experience_batch,
)
from rollserve.server.config import ServerConfig
from rollserve.server.experience.timing import PHASES, TOKENS_PER_S_KEY, phase_key
from rollserve.server.generation import GenerationSettings, built_engine
from rollserve.server.models import ModelSet, load_models
from rollserve.server.serving.app import RolloutServer
from rollserve.server.state import Phase
from rollserve.v1 import rollout_pb2 as pb

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [40], [70, 71]]
GRPO = dict(
    samples_per_prompt=2,
    max_new_tokens=8,
    algorithm={"advantage_estimator": "group_norm"},
    rewards=["exact_match"],
    gt_answers=["a", "b", "c", "d"],
    seed=3,
)


@pytest.fixture(scope="module")
def models(tiny_actor_dir) -> ModelSet:
    return load_models(ServerConfig(actor=str(tiny_actor_dir), device="cpu"))


@pytest.fixture(scope="module")
def server(models: ModelSet) -> Iterator[RolloutServer]:
    server = serve_in_process(models, micro_batch_size=4)
    yield server
    server.stop(0)


@pytest.fixture(scope="module")
def client(server: RolloutServer) -> Iterator[RolloutClient]:
    with RolloutClient(server.address, timeout_s=60) as client:
        yield client


# ---- behaviour log-probs ---------------------------------------------------------------------


def _assert_behaviour_matches_rescored(e: Experience) -> None:
    """Recorded while sampling == re-scored by teacher forcing, on every valid action column
    (the same float32 forward on the CPU, up to rounding); 0 after each response."""
    assert e.rollout_log_probs is not None
    assert e.rollout_log_probs.shape == e.action_log_probs.shape
    assert e.rollout_log_probs.dtype == torch.float32
    mask = e.action_mask
    assert mask.any()
    torch.testing.assert_close(
        e.rollout_log_probs[mask], e.action_log_probs[mask], atol=1e-4, rtol=1e-4
    )
    assert (e.rollout_log_probs[~mask] == 0).all()
    assert (e.rollout_log_probs[mask] < 0).any()  # real log-probs, not a zero table


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["sampled", "greedy"])
def test_behaviour_log_probs_come_back_over_grpc_equal_to_the_rescored_ones(
    client: RolloutClient, temperature: float
) -> None:
    streamed = list(client.stream_experience(PROMPTS, temperature=temperature, **GRPO))
    assert len(streamed) == 2  # 8 rows in micro-batches of 4
    for micro_batch in streamed:
        _assert_behaviour_matches_rescored(micro_batch)
    _assert_behaviour_matches_rescored(concat_experiences(streamed))


def test_behaviour_log_probs_follow_rows_through_the_buffer(client: RolloutClient) -> None:
    e = client.make_experience(PROMPTS, **GRPO)
    items = split_experience_batch(e)
    assert all(item.rollout_log_probs is not None for item in items)
    again = make_experience_batch(items)
    assert torch.equal(again.rollout_log_probs, e.rollout_log_probs)


# ---- compatibility with peers that predate the field ----------------------------------------


def _old_experience_class() -> type:
    """rollserve.v1.Experience as a peer built before rollout_log_probs had it: the same file
    descriptor without that field, in a pool of its own."""
    file_proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(file_proto)
    experience = next(m for m in file_proto.message_type if m.name == "Experience")
    kept = [f for f in experience.field if f.name != "rollout_log_probs"]
    assert len(kept) == len(experience.field) - 1
    del experience.field[:]
    experience.field.extend(kept)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("rollserve.v1.Experience"))


def test_an_old_peer_and_a_new_one_read_each_others_experience(client: RolloutClient) -> None:
    new = client.make_experience(PROMPTS, **GRPO)
    old_class = _old_experience_class()
    # An old client reads a new server's message (the unknown field is skipped).
    old_message = old_class.FromString(experience_to_proto(new).SerializeToString())
    assert torch.equal(
        experience_from_proto(pb.Experience.FromString(old_message.SerializeToString())).sequences,
        new.sequences,
    )
    # A new client reads an old server's message: an Experience without the field decodes.
    without = dataclasses.replace(new, rollout_log_probs=None)
    stripped = old_class.FromString(experience_to_proto(without).SerializeToString())
    decoded = experience_from_proto(pb.Experience.FromString(stripped.SerializeToString()))
    assert decoded.rollout_log_probs is None
    assert torch.equal(decoded.action_log_probs, new.action_log_probs)
    # Rows without it batch like rows of any optional field left unset.
    assert make_experience_batch(split_experience_batch(decoded)).rollout_log_probs is None


# ---- phase timings ---------------------------------------------------------------------------


def _request_seconds(e: Experience) -> dict[str, float]:
    return {phase: float(e.info[phase_key(phase)].double().sum()) for phase in PHASES}


def test_phase_timings_come_back_per_row_and_sum_to_the_request_in_metrics(
    server: RolloutServer, client: RolloutClient
) -> None:
    registry = server.metrics.registry
    count = "rollserve_phase_seconds_count"
    before = {p: registry.get_sample_value(count, {"phase": p}) or 0.0 for p in PHASES}
    before_sum = registry.get_sample_value("rollserve_phase_seconds_sum", {"phase": "generate"})
    rates_before = registry.get_sample_value("rollserve_generation_tokens_per_second_count") or 0
    # 8 rows in generation batches of 4 (two batches), streamed in micro-batches of 4.
    e = client.make_experience(PROMPTS, generate_batch_size=4, **GRPO)
    seconds = _request_seconds(e)
    for phase in ("generate", "score_actor", "decode", "rewards", "shape"):
        assert seconds[phase] > 0, phase
    assert seconds["score_critic"] == 0 and seconds["score_reward_model"] == 0  # none loaded
    for key in [phase_key(p) for p in PHASES] + [TOKENS_PER_S_KEY]:
        assert e.info[key].shape == (8,) and e.info[key].dtype == torch.float32, key
    # One value per generation batch: its seconds / its 4 rows on each of its rows.
    generate = e.info[phase_key("generate")]
    assert torch.equal(generate[:4], generate[:1].expand(4))
    assert torch.equal(generate[4:], generate[4:5].expand(4))
    rate = e.info[TOKENS_PER_S_KEY]
    first_tokens = float(e.info["response_length"][:4].sum())
    assert float(rate[0]) == pytest.approx(first_tokens / float(generate[:4].sum()), rel=1e-4)
    # Metrics: one observation per request and phase that ran, of the request's seconds.
    for phase in PHASES:
        observed = registry.get_sample_value(count, {"phase": phase}) or 0.0
        assert observed - before[phase] == (1.0 if seconds[phase] > 0 else 0.0), phase
    after_sum = registry.get_sample_value("rollserve_phase_seconds_sum", {"phase": "generate"})
    assert after_sum - (before_sum or 0.0) == pytest.approx(seconds["generate"], rel=1e-4)
    rates = registry.get_sample_value("rollserve_generation_tokens_per_second_count")
    assert rates - rates_before == 1


def test_whitened_requests_spread_the_shaping_over_every_row(client: RolloutClient) -> None:
    options = dict(GRPO, algorithm={"advantage_estimator": "group_norm", "whitening": "global"})
    e = client.make_experience(PROMPTS, generate_batch_size=4, **options)
    shape = e.info[phase_key("shape")]
    assert (shape > 0).all() and torch.equal(shape, shape[:1].expand(8))  # one shaping, 8 rows


# ---- the generation path in Health, its flags, the warm-up before SERVING ------------------


def test_health_says_hf_with_no_kv_cache_on_the_cpu_by_default(client: RolloutClient) -> None:
    health = client.health()
    assert health.generation_path == "hf" and health.kv_cache_tokens == 0


def test_health_and_metrics_name_the_functions_that_fell_back_to_eager(
    server: RolloutServer, client: RolloutClient
) -> None:
    # A GPU server whose compiler fails (no C compiler for Triton, an Inductor bug) runs those
    # functions eagerly, several times slower: Health names them, and /metrics has a gauge of
    # each (an alert's hook). Here a function whose compile really fails (fullgraph cannot
    # trace .item()), in the server's process.
    from rollserve.server.generation.compiling import maybe_compiled

    def health_probe_data_dependent(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum().item() > 0 else x

    name = health_probe_data_dependent.__qualname__
    assert name not in client.health().eager_fallbacks
    gauge = server.metrics.registry.get_sample_value
    assert gauge("rollserve_eager_fallback", {"function": name}) is None
    fn = maybe_compiled(health_probe_data_dependent, True)
    assert torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))  # eager, right
    fallbacks = client.health().eager_fallbacks
    assert name in fallbacks and list(fallbacks) == sorted(fallbacks)
    assert gauge("rollserve_eager_fallback", {"function": name}) == 1


def test_the_flags_are_the_one_source_of_the_generation_settings() -> None:
    config = ServerConfig.from_args(
        ["--generation-path", "rollserve", "--kv-cache-tokens", "2048"],
        {"ROLLSERVE_GPU_MEMORY_UTILIZATION": "0.7"},
    )
    assert GenerationSettings.from_config(config) == GenerationSettings("rollserve", 2048, 0.7)
    assert GenerationSettings.from_config(ServerConfig()) == GenerationSettings()
    with pytest.raises(ValueError, match="generation path"):
        GenerationSettings(path="vllm")


@pytest.fixture()
def fresh_models(tiny_actor_dir) -> ModelSet:
    """Models of their own, so that no engine was built for them by another test."""
    return load_models(ServerConfig(actor=str(tiny_actor_dir), device="cpu"))


def test_the_engine_path_is_warmed_up_before_serving_and_reported_in_health(
    fresh_models: ModelSet,
) -> None:
    actor = fresh_models.actor.module
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        device="cpu",
        log_level="WARNING",
        generation_path="rollserve",
        kv_cache_tokens=8192,
        generate_batch_size=8,
        max_new_tokens=8,
    )
    server = RolloutServer(config, models=fresh_models)
    # What the engine held at the moment each phase was reported (Health reads the phase).
    seen: list[tuple[Phase, int]] = []

    def note(phase: Phase) -> None:
        engine = built_engine(actor)
        seen.append((phase, 0 if engine is None else len(engine._workspaces)))

    server.state.on_phase_change(note)
    assert built_engine(actor) is None
    server.start()
    try:
        serving = [workspaces for phase, workspaces in seen if phase is Phase.SERVING]
        assert serving and serving[0] >= 1  # the warm-up's workspace existed before SERVING
        engine = built_engine(actor)
        assert engine is not None and engine.capacity_tokens == 8192
        warmed = next(iter(engine._workspaces.values()))
        assert warmed.rows == 8  # generate_batch_size rows, the server's default shape
        with RolloutClient(server.address, timeout_s=60) as client:
            health = client.health()
            assert health.serving
            assert health.generation_path == "rollserve" and health.kv_cache_tokens == 8192
            # Requests run on the engine: behaviour log-probs from its own forward still
            # equal the HF scoring forward within float32 rounding.
            e = client.make_experience(PROMPTS, **dict(GRPO, max_new_tokens=8))
            _assert_behaviour_matches_rescored(e)
    finally:
        server.stop(0)


def test_without_a_token_budget_the_cpu_engine_takes_its_fixed_budget(
    fresh_models: ModelSet,
) -> None:
    server = serve_in_process(fresh_models, generation_path="rollserve", generate_batch_size=4)
    try:
        with RolloutClient(server.address, timeout_s=60) as client:
            health = client.health()
        assert health.generation_path == "rollserve"
        assert health.kv_cache_tokens == built_engine(fresh_models.actor.module).capacity_tokens
        assert health.kv_cache_tokens > 0
    finally:
        server.stop(0)


def test_behaviour_log_probs_equal_the_rescored_ones_on_the_causal_route(
    fresh_models: ModelSet, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On the engine path, rows past causal_rows.CAUSAL_MIN_COLUMNS (here every row) prefill
    # and score with causal attention over rolled rows, while decoding attends the cache under
    # its mask: what was recorded while sampling must still be what scoring gives, through the
    # whole service (prompts of a group once and rows' own).
    from rollserve.server.generation import causal_rows
    from rollserve.server.generation import model as generation_model

    monkeypatch.setenv(causal_rows.CAUSAL_MIN_COLUMNS_ENV, "0")
    calls: list[int] = []

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return causal_rows.causal_attention(*args)

    monkeypatch.setattr(generation_model, "causal_attention", counted)
    server = serve_in_process(fresh_models, generation_path="rollserve", generate_batch_size=4)
    try:
        with RolloutClient(server.address, timeout_s=60) as client:
            for samples in (2, 1):
                calls.clear()
                options = dict(GRPO, samples_per_prompt=samples, temperature=1.0)
                streamed = list(client.stream_experience(PROMPTS, **options))
                assert calls  # the prefill's and the scoring's forwards took the causal route
                for micro_batch in streamed:
                    _assert_behaviour_matches_rescored(micro_batch)
    finally:
        server.stop(0)
