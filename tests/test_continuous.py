"""Continuous rollout (issue 7): prompt source, schedule, dealing, staleness, Subscribe, Health.

Unit tests cover the prompt file, the schedule and the dealer's ring. In-process servers (one set
of tiny models loaded for the module) cover Subscribe, max_batches, back-pressure, staleness and
progress. The acceptance test runs a real server process and two real trainer processes
(examples/subscribe_trainer.py), one of which is killed mid-stream.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch
from helpers_server import ServerProcess
from helpers_wait import wait_until as wait_until_within
from prometheus_client import generate_latest
from rollserve.client import AsyncRolloutClient, FailedPrecondition, RolloutClient
from rollserve.client.calls import SubscribedBatch
from rollserve.client.protocol.errors import InvalidArgument
from rollserve.client.protocol.experience import experience_from_proto
from rollserve.client.protocol.reward_moments import RunningRewardMoments
from rollserve.server.config import ConfigError, ServerConfig
from rollserve.server.continuous import (
    Dealer,
    MadeBatch,
    PlannedBatch,
    RolloutSetupError,
    build_batch_request,
    load_prompt_source,
    load_request_template,
    plan_batches,
)
from rollserve.server.models import ModelSet, load_models
from rollserve.server.serving.app import RolloutServer
from rollserve.v1 import rollout_pb2 as pb
from rollserve.v1 import rollout_pb2_grpc

TRAINER = Path(__file__).resolve().parents[1] / "examples" / "subscribe_trainer.py"
NUM_PROMPTS, PER_BATCH, GROUP = 8, 2, 2
BATCHES_PER_EPOCH = NUM_PROMPTS // PER_BATCH
# GRPO groups of 2 rewarded by exact_match against each prompt's answer; short responses.
TEMPLATE = {
    "samplesPerPrompt": GROUP,
    "sampling": {"maxNewTokens": 6},
    "algorithm": {"advantageEstimator": "group_norm"},
    "rewards": [{"source": "exact_match"}],
}
WAIT_S = 60.0
_wait_until = functools.partial(wait_until_within, within_s=WAIT_S)


def _write_jsonl(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def _write_template(path: Path, template: dict) -> Path:
    path.write_text(json.dumps(template))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rollout")
    prompts = [{"prompt": f"q{i}=", "gt_answer": str(i)} for i in range(NUM_PROMPTS)]
    return {
        "prompts": _write_jsonl(root / "prompts.jsonl", prompts),
        "request": _write_template(root / "request.json", TEMPLATE),
    }


@pytest.fixture(scope="module")
def models(tiny_actor_dir: Path) -> ModelSet:
    return load_models(ServerConfig(device="cpu", actor=str(tiny_actor_dir)))


@pytest.fixture(scope="module")
def actor_weights(models: ModelSet) -> dict[str, torch.Tensor]:
    # The actor's own weights: pushing them moves the version and leaves the shared models as
    # they are (every server of the module uses the same modules).
    return {name: t.detach().clone() for name, t in models.actor.module.state_dict().items()}


@contextmanager
def serving(models: ModelSet, files: dict[str, Path] | None, **config: object):
    rollout = {}
    if files is not None:
        rollout = dict(
            rollout_prompts=str(files["prompts"]),
            rollout_request=str(files["request"]),
            rollout_prompts_per_batch=PER_BATCH,
        )
    server = RolloutServer(
        ServerConfig(
            host="127.0.0.1",
            port=0,
            device="cpu",
            log_level="WARNING",
            metrics_port=0,
            **{**rollout, **config},
        ),
        models=models,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop(0)


def _progress(target: str) -> pb.RolloutProgress:
    with grpc.insecure_channel(target) as channel:
        return rollout_pb2_grpc.RolloutStub(channel).Health(pb.HealthRequest(), timeout=10).rollout


def _groups(prompt_ids: list[int]) -> list[int]:
    """One prompt id per group of GROUP consecutive rows (every row of a group shares it)."""
    assert len(prompt_ids) % GROUP == 0
    groups = [prompt_ids[i : i + GROUP] for i in range(0, len(prompt_ids), GROUP)]
    assert all(len(set(group)) == 1 for group in groups), prompt_ids
    return [group[0] for group in groups]


def _assert_each_prompt_once_per_epoch(batches: list[dict], epochs: int) -> None:
    """Every step once, and every prompt id exactly once in each epoch (by prompt ids)."""
    steps = sorted(b["step"] for b in batches)
    assert steps == list(range(epochs * BATCHES_PER_EPOCH))
    by_epoch: dict[int, list[int]] = collections.defaultdict(list)
    for b in batches:
        by_epoch[b["epoch"]] += _groups(b["prompt_ids"])
    assert sorted(by_epoch) == list(range(epochs))
    for ids in by_epoch.values():
        assert sorted(ids) == list(range(NUM_PROMPTS))


def _as_record(batch: SubscribedBatch) -> dict:
    return {
        "batch_index": batch.batch_index,
        "epoch": batch.epoch,
        "step": batch.step,
        "prompt_ids": batch.experience.prompt_index.tolist(),
        "policy_versions": batch.experience.policy_version.tolist(),
    }


# ---- prompt source, schedule, request ---------------------------------------------------------


def test_prompt_source_reads_texts_ids_and_answers(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "gt_answer": "1"}\n\n{"prompt": "b", "id": 7}\n')
    source = load_prompt_source(path)
    assert [(p.row, p.text, p.gt_answer) for p in source.prompts] == [(0, "a", "1"), (1, "b", None)]
    assert source.is_text and source.has_gt_answers
    ids = load_prompt_source(_write_jsonl(tmp_path / "i.jsonl", [{"prompt_ids": [5, 6]}]))
    assert ids.prompts[0].token_ids == (5, 6) and not ids.is_text and not ids.has_gt_answers


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt": "a"}\nnot json\n', "p.jsonl:2: not JSON"),
        ('{"prompt": ""}\n', "p.jsonl:1: prompt must be a non-empty string"),
        ('{"prompt": "a", "prompt_ids": [1]}\n', "one of prompt, prompt_ids"),
        ('{"prompt_ids": [1, -2]}\n', "ids >= 0"),
        ('{"prompt": "a", "gt_answer": 3}\n', "gt_answer must be a string"),
        ('{"prompt": "a"}\n{"prompt_ids": [1]}\n', "mixes prompt and prompt_ids"),
        ("\n\n", "no prompts"),
    ],
)
def test_prompt_source_refuses_bad_lines(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(RolloutSetupError, match=message):
        load_prompt_source(path)


def test_schedule_shuffles_each_epoch_and_makes_every_prompt_once() -> None:
    plan = list(plan_batches(10, 3, seed=0, epochs=2))
    assert [b.step for b in plan] == list(range(8))
    assert [b.epoch for b in plan] == [0] * 4 + [1] * 4
    assert [len(b.rows) for b in plan] == [3, 3, 3, 1] * 2  # batches never span epochs
    first = [row for b in plan[:4] for row in b.rows]
    second = [row for b in plan[4:] for row in b.rows]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second and first != list(range(10))  # shuffled, differently per epoch
    assert plan == list(plan_batches(10, 3, seed=0, epochs=2))  # the seed decides
    assert plan != list(plan_batches(10, 3, seed=1, epochs=2))


def test_schedule_stops_at_steps_or_epochs() -> None:
    steps_only = list(plan_batches(4, 3, seed=0, epochs=0, steps=5))  # epochs unlimited
    assert [(b.step, b.epoch) for b in steps_only] == [(0, 0), (1, 0), (2, 1), (3, 1), (4, 2)]
    assert len(list(plan_batches(4, 3, seed=0, epochs=1, steps=100))) == 2


def test_batch_request_is_the_template_plus_the_batch(files: dict[str, Path]) -> None:
    template = load_request_template(files["request"])
    source = load_prompt_source(files["prompts"])
    request = build_batch_request(template, source, PlannedBatch(3, 1, (5, 2)), seed=0)
    assert list(request.texts.texts) == ["q5=", "q2="]
    assert list(request.gt_answers) == ["5", "2"]
    assert request.samples_per_prompt == GROUP and request.sampling.max_new_tokens == 6
    assert request.rewards[0].source == "exact_match" and request.request_id == "rollout-3"
    assert request.batching.micro_batch_size == 2 * GROUP  # one message per batch
    other = build_batch_request(template, source, PlannedBatch(4, 1, (5, 2)), seed=0)
    assert other.sampling.seed != request.sampling.seed  # a sampling seed per step


def test_template_must_not_hold_prompts(tmp_path: Path) -> None:
    bad = _write_template(tmp_path / "r.json", {"texts": {"texts": ["x"]}})
    with pytest.raises(RolloutSetupError, match="holds prompts"):
        load_request_template(bad)
    (tmp_path / "broken.json").write_text('{"samplesPerPrompt": "many"}')
    with pytest.raises(RolloutSetupError, match="broken.json"):
        load_request_template(tmp_path / "broken.json")


def test_config_staleness_and_template_flags() -> None:
    assert ServerConfig.from_args(["--max-staleness", "unlimited"], {}).max_staleness is None
    assert ServerConfig.from_args([], {"ROLLSERVE_MAX_STALENESS": "0"}).max_staleness == 0
    assert ServerConfig().max_staleness == 1
    with pytest.raises(ConfigError, match="must be >= 0"):
        ServerConfig.from_args(["--max-staleness", "-1"], {})
    with pytest.raises(ConfigError, match="needs rollout_prompts"):
        ServerConfig.from_args(["--rollout-request", "r.json"], {})


# ---- the dealer -------------------------------------------------------------------------------


def _made(step: int, version: int = 0) -> MadeBatch:
    return MadeBatch(response=pb.SubscribeResponse(step=step), policy_version=version)


def test_dealer_deals_round_robin_and_returns_batches_of_a_dead_call() -> None:
    versions = {"newest": 0}
    dealer = Dealer(capacity=8, newest_version=lambda: versions["newest"], max_staleness=1)
    a = dealer.join("a", 0, lambda: True)
    dead = {"b": False}
    b = dealer.join("b", 0, lambda: not dead["b"])
    for step in range(5):
        dealer.put(_made(step))
    assert dealer.take(a).step == 0 and dealer.take(b).step == 1 and dealer.take(a).step == 2
    dead["b"] = True  # b's call ended before its cancel callback ran
    assert dealer.take(b) is None and b.gone
    taken = dealer.take(a)
    assert (taken.step, taken.batch_index) == (3, 3)  # batch 3 came back for a; no index gap
    versions["newest"] = 2  # batch 4 (version 0) is now two versions behind
    dealer.finish()
    assert dealer.take(a) is None  # dropped, and nothing else will come: the stream ends
    assert dealer.counts() == (True, 4, 1, 0, 1)  # finished, delivered, dropped, queued, subs


def test_dealer_max_batches_leaves_the_ring() -> None:
    dealer = Dealer(capacity=8, newest_version=lambda: 0, max_staleness=None)
    a = dealer.join("a", 1, lambda: True)
    b = dealer.join("b", 0, lambda: True)
    for step in range(3):
        dealer.put(_made(step))
    assert dealer.take(a).step == 0 and a.gone  # max_batches reached: out of the ring
    assert dealer.take(b).step == 1 and dealer.take(b).step == 2  # b's turn every time now
    assert dealer.take(a) is None


def test_dealer_deals_around_a_subscriber_that_stays_away() -> None:
    # "stuck" took a batch and never comes back (its handler blocked sending to a client that
    # does not read): after turn_wait_s it loses its turn, and every turn while it stays away.
    dealer = Dealer(capacity=8, newest_version=lambda: 0, max_staleness=None, turn_wait_s=0.2)
    stuck = dealer.join("stuck", 0, lambda: True)
    reader = dealer.join("reader", 0, lambda: True)
    for step in range(6):
        dealer.put(_made(step))
    assert dealer.take(stuck).step == 0
    started = time.monotonic()
    assert [dealer.take(reader).step for _ in range(4)] == [1, 2, 3, 4]
    assert time.monotonic() - started < 5.0  # one turn_wait_s, not one per skipped turn
    assert dealer.take(stuck).step == 5  # back: the ring deals to it again
    assert dealer.counts() == (False, 6, 0, 0, 2)


def test_dealer_keeps_the_turn_of_a_subscriber_that_comes_back_in_time() -> None:
    # A slow trainer (away less than turn_wait_s) keeps its turn: strict round-robin.
    dealer = Dealer(capacity=8, newest_version=lambda: 0, max_staleness=None, turn_wait_s=60.0)
    slow = dealer.join("slow", 0, lambda: True)
    reader = dealer.join("reader", 0, lambda: True)
    for step in range(4):
        dealer.put(_made(step))
    assert dealer.take(slow).step == 0 and dealer.take(reader).step == 1
    taken: list[int] = []
    waiting = threading.Thread(target=lambda: taken.append(dealer.take(reader).step))
    waiting.start()  # the slow one's turn: the reader waits for it
    assert dealer.take(slow).step == 2
    waiting.join(WAIT_S)
    assert taken == [3]


def test_dealer_hands_a_windowed_subscriber_at_most_its_window() -> None:
    dealer = Dealer(capacity=8, newest_version=lambda: 0, max_staleness=None)
    sub = dealer.join("w", 0, lambda: True, window=2)
    for step in range(4):
        dealer.put(_made(step))
    assert dealer.take(sub).step == 0 and dealer.take(sub).step == 1
    assert sub.unacknowledged == 2 and not sub.has_room
    taken: list[int] = []
    waiting = threading.Thread(target=lambda: taken.append(dealer.take(sub).step))
    waiting.start()  # at its window: it waits although two batches are queued
    _wait_until(lambda: sub.waiting, "the subscriber waits in take")
    assert taken == [] and dealer.counts()[3] == 2  # nothing handed over while it has no room
    sub.acknowledge(1)  # the trainer took one: one more may go
    waiting.join(WAIT_S)
    assert taken == [2] and sub.unacknowledged == 2
    with pytest.raises(InvalidArgument, match="taken: must be 1 to the 2"):
        sub.acknowledge(3)
    sub.close_acknowledgements()  # no more credit will come: the stream ends
    assert dealer.take(sub) is None
    assert dealer.counts() == (False, 3, 0, 1, 1)


def test_dealer_lookahead_is_one_batch_per_windowed_subscriber() -> None:
    dealer = Dealer(capacity=3, newest_version=lambda: 0, max_staleness=None)
    assert not dealer._ring
    a = dealer.join("a", 0, lambda: True, window=4)
    assert dealer._lookahead_locked() == 1  # the batch `a` takes next
    dealer.join("b", 0, lambda: True, window=1)
    assert dealer._lookahead_locked() == 2
    legacy = dealer.join("legacy", 0, lambda: True)  # no window: the whole queue
    assert dealer._lookahead_locked() == 3
    dealer.leave(legacy)
    dealer.leave(a)
    assert dealer._lookahead_locked() == 1
    with pytest.raises(InvalidArgument, match="window: must be 1 to 16"):
        dealer.join("big", 0, lambda: True, window=17)


def test_dealer_checks_staleness_at_hand_over() -> None:
    versions = {"newest": 0}
    dealer = Dealer(capacity=8, newest_version=lambda: versions["newest"], max_staleness=1)
    sub = dealer.join("w", 0, lambda: True, window=1)
    dealer.put(_made(0, version=0))
    dealer.put(_made(1, version=0))
    assert dealer.take(sub).step == 0
    versions["newest"] = 2  # batch 1 went stale while queued, waiting for an acknowledgement
    dealer.put(_made(2, version=2))
    sub.acknowledge(1)
    assert dealer.take(sub).step == 2  # batch 1 was dropped when it would have been handed
    assert dealer.counts() == (False, 2, 1, 0, 1)


# ---- in-process servers -----------------------------------------------------------------------


def test_subscribe_without_a_prompt_source_fails_precondition(models: ModelSet) -> None:
    with serving(models, None) as server, RolloutClient(server.address) as client:
        with pytest.raises(FailedPrecondition, match="no continuous rollout"):
            next(client.subscribe("t"))
        assert _progress(server.address) == pb.RolloutProgress()  # enabled false
        with pytest.raises(ValueError, match="max_batches"):
            next(client.subscribe("t", max_batches=-1))


def test_max_batches_hands_the_rest_to_the_next_subscriber(
    models: ModelSet, files: dict[str, Path]
) -> None:
    with (
        serving(models, files, rollout_epochs=2) as server,
        RolloutClient(server.address) as client,
    ):
        with grpc.insecure_channel(server.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                next(stub.Subscribe(iter([pb.SubscribeRequest(max_batches=-2)]), timeout=10))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        first = [_as_record(b) for b in client.subscribe("first", max_batches=3)]
        rest = [_as_record(b) for b in client.subscribe("rest", timeout_s=WAIT_S)]
        assert len(first) == 3
        assert [b["batch_index"] for b in first + rest] == list(range(2 * BATCHES_PER_EPOCH))
        _assert_each_prompt_once_per_epoch(first + rest, epochs=2)
        progress = _progress(server.address)
        assert progress.enabled and progress.finished
        assert (progress.epoch, progress.step) == (1, 2 * BATCHES_PER_EPOCH)
        assert progress.batches_delivered == 2 * BATCHES_PER_EPOCH
        assert progress.queued_batches == progress.subscribers == 0
        assert list(client.subscribe("late", timeout_s=WAIT_S)) == []  # finished: ends at once


def test_the_loop_pauses_when_the_queue_is_full(
    models: ModelSet, files: dict[str, Path], actor_weights: dict[str, torch.Tensor]
) -> None:
    queue = 2
    with serving(models, files, rollout_epochs=0, rollout_queue_batches=queue) as server:
        rollout = server.rollout
        # A subscriber that takes nothing: demand, but no room once the queue is full.
        idle = rollout.subscribe("idle", 0, lambda: True)
        _wait_until(lambda: rollout.stats().queued == queue, "the queue fills up")
        with RolloutClient(server.address) as client:
            # An engine job after any make job the loop could have queued: none was.
            client.update_weights(actor_weights, version=1)
        assert rollout.stats().made == queue
        batches = iter(idle)
        assert next(batches).batch_index == 0  # room for one more batch, and only one
        _wait_until(lambda: rollout.stats().queued == queue, "the loop refills the queue")
        stats = rollout.stats()
        assert (stats.made, stats.delivered) == (queue + 1, 1)
        batches.close()  # leaves the ring
        assert rollout.stats().subscribers == 0


def _watch_declines(rollout) -> threading.Event:
    """An event set when the rollout loop's thread asks whether it may make a batch and hears
    no: it then waits for a phase change. (Observes ContinuousRollout._can_make; the answer is
    unchanged. The engine thread's own check is not the loop's wait and is left out.)"""
    declined = threading.Event()
    can_make = rollout._can_make

    def watched() -> bool:
        answer = can_make()
        if not answer and threading.current_thread().name == "rollserve-rollout":
            declined.set()
        return answer

    rollout._can_make = watched
    return declined


def _versions(response: pb.SubscribeResponse) -> set[int]:
    return set(experience_from_proto(response.experience).policy_version.tolist())


def test_no_batch_is_made_on_weights_that_fail_their_probe(
    models: ModelSet, files: dict[str, Path], actor_weights: dict[str, torch.Tensor]
) -> None:
    norm = "model.norm.weight"
    with (
        serving(models, files, rollout_epochs=0, rollout_queue_batches=1) as server,
        RolloutClient(server.address) as client,
    ):
        rollout, engine = server.rollout, server.runtime.engine
        idle = rollout.subscribe("idle", 0, lambda: True)
        _wait_until(lambda: rollout.stats().queued == 1, "the queue fills up: the loop pauses")
        # Hold the engine; queue the swap of weights that produce NaN, then make room so that
        # the loop queues its next batch behind the swap (and behind the probe that follows it).
        gate, gated = threading.Event(), threading.Event()
        held = engine.submit(lambda: (gated.set(), gate.wait(WAIT_S)))
        assert gated.wait(WAIT_S)
        pushed = threading.Thread(
            target=client.update_weights,
            args=({norm: torch.full_like(actor_weights[norm], float("nan"))},),
            kwargs=dict(version=1, mode="partial", allow_non_finite=True),
        )
        pushed.start()
        _wait_until(lambda: engine.queue_depth == 1, "the swap waits behind the gate")
        batches = iter(idle)
        assert _versions(next(batches)) == {0}
        _wait_until(lambda: engine.queue_depth == 2, "the loop queues a batch behind the swap")
        made = rollout.stats().made
        declined = _watch_declines(rollout)
        gate.set()
        held.result()
        pushed.join(WAIT_S)
        _wait_until(lambda: server.state.phase.value == "waiting_for_weights", "probe failed")
        # The queued batch job has run and the loop is back waiting for a phase it may make in:
        # from here on only new weights (a phase change) let it make a batch.
        _wait_until(
            lambda: declined.is_set() or rollout.stats().made != made,
            "the loop declines to make a batch while waiting for weights",
        )
        assert rollout.stats().made == made, "a batch was made on weights that failed the probe"
        client.update_weights({norm: actor_weights[norm]}, version=2, mode="partial")
        assert _versions(next(batches)) == {2}
        batches.close()


def test_no_batch_is_sent_more_than_one_version_behind(
    models: ModelSet, files: dict[str, Path], actor_weights: dict[str, torch.Tensor]
) -> None:
    config = dict(rollout_epochs=2, max_staleness=1, rollout_queue_batches=3)
    with serving(models, files, **config) as server, RolloutClient(server.address) as client:
        received: list[SubscribedBatch] = []
        # (batches delivered when the push had landed, version pushed): a batch with a
        # batch_index at or above that count was dealt after the push.
        pushes: list[tuple[int, int]] = []
        for batch in client.subscribe("trainer", timeout_s=WAIT_S):
            received.append(batch)
            version = len(received)
            client.update_weights(actor_weights, version=version)
            pushes.append((_progress(server.address).batches_delivered, version))
        for batch in received:
            newest = max(
                (v for delivered, v in pushes if delivered <= batch.batch_index), default=0
            )
            assert int(batch.experience.policy_version.min()) >= newest - 1, (batch, pushes)
        progress = _progress(server.address)
        assert progress.finished and progress.step == 2 * BATCHES_PER_EPOCH
        assert progress.batches_delivered == len(received)
        assert progress.batches_delivered + progress.batches_dropped_stale == progress.step
        assert [b.batch_index for b in received] == list(range(len(received)))


def test_stale_batches_are_dropped_and_counted(
    models: ModelSet, files: dict[str, Path], actor_weights: dict[str, torch.Tensor]
) -> None:
    with (
        serving(models, files, rollout_epochs=0, max_staleness=1) as server,
        RolloutClient(server.address) as client,
    ):
        stream = client.subscribe("first", timeout_s=WAIT_S)  # window 1
        assert next(stream).experience.policy_version.tolist() == [0] * PER_BATCH * GROUP
        # The trainer has not asked for its next batch: the loop makes one more (version 0),
        # which waits in the queue (the lookahead of one window of 1), and makes no other.
        _wait_until(lambda: _progress(server.address).queued_batches == 1, "a batch waits")
        stream.close()
        _wait_until(lambda: _progress(server.address).subscribers == 0, "the subscriber left")
        before = _progress(server.address)
        assert (before.step, before.batches_delivered) == (2, 1)
        client.update_weights(actor_weights, version=1)
        client.update_weights(actor_weights, version=2)  # the queued batch is now 2 behind
        (batch,) = client.subscribe("second", max_batches=1, timeout_s=WAIT_S)
        assert batch.experience.policy_version.tolist() == [2] * PER_BATCH * GROUP
        after = _progress(server.address)
        assert after.batches_dropped_stale == before.batches_dropped_stale + 1 == 1
        assert after.batches_delivered == before.batches_delivered + 1
        scraped = generate_latest(server.metrics.registry).decode()
        assert "rollserve_rollout_batches_dropped_stale_total 1.0" in scraped
        assert f"rollserve_rollout_batches_delivered_total {after.batches_delivered}.0" in scraped


def test_a_failing_batch_is_skipped_and_counted(models: ModelSet, tmp_path: Path) -> None:
    plan = list(plan_batches(4, 1, seed=0, epochs=1))
    too_long = plan[1].rows[0]  # not in the first batch, which the start-up check decodes
    prompts = [
        {"prompt": "x" * 600 if row == too_long else f"q{row}=", "gt_answer": "1"}
        for row in range(4)
    ]  # 600 tokens are more than the tiny model's context of 512
    files = {
        "prompts": _write_jsonl(tmp_path / "p.jsonl", prompts),
        "request": _write_template(tmp_path / "r.json", TEMPLATE),
    }
    with (
        serving(models, files, rollout_prompts_per_batch=1) as server,
        RolloutClient(server.address) as client,
    ):
        got = [_groups(b.experience.prompt_index.tolist()) for b in client.subscribe("t")]
        assert sorted(ids[0] for ids in got) == sorted(set(range(4)) - {too_long})
        progress = _progress(server.address)
        assert progress.finished and (progress.step, progress.batches_delivered) == (4, 3)
        assert server.rollout.stats().failed == 1
        scraped = generate_latest(server.metrics.registry).decode()
        assert "rollserve_rollout_batches_failed_total 1.0" in scraped


def test_async_client_subscribes_and_cancels(models: ModelSet, files: dict[str, Path]) -> None:
    async def main() -> tuple[list[SubscribedBatch], SubscribedBatch]:
        async with AsyncRolloutClient(server.address) as client:
            two = [b async for b in client.subscribe("aio", max_batches=2, timeout_s=WAIT_S)]
            stream = client.subscribe("aio-early", timeout_s=WAIT_S)
            first = await stream.__anext__()
            await stream.aclose()  # cancels the call: the server drops the subscriber
            return two, first

    with serving(models, files, rollout_epochs=0) as server:
        two, first = asyncio.run(main())
        assert [b.batch_index for b in two] == [0, 1] and first.batch_index == 2
        assert isinstance(two[0].experience.prompt_index, torch.Tensor)
        _wait_until(lambda: _progress(server.address).subscribers == 0, "the call is cancelled")


def test_async_client_reads_a_rollout_to_its_end(models: ModelSet, files: dict[str, Path]) -> None:
    # The server ends the stream while the client may be acknowledging its last batch: the
    # stream still ends OK (grpc.aio reported such an end as INTERNAL; the client reads a sync
    # call instead).
    async def main() -> list[SubscribedBatch]:
        async with AsyncRolloutClient(server.address) as client:
            return [b async for b in client.subscribe("aio-all", window=2, timeout_s=WAIT_S)]

    with serving(models, files) as server:  # one epoch
        batches = asyncio.run(main())
    assert [b.batch_index for b in batches] == list(range(BATCHES_PER_EPOCH))


def test_bad_rollout_setup_fails_the_start(models: ModelSet, tmp_path: Path) -> None:
    no_answers = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    template = _write_template(tmp_path / "r.json", TEMPLATE)  # exact_match needs answers
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        device="cpu",
        metrics_port=0,
        rollout_prompts=str(no_answers),
        rollout_request=str(template),
    )
    server = RolloutServer(config, models=models)
    try:
        with pytest.raises(RolloutSetupError, match="gt_answers"):
            server.start()
    finally:
        server.stop(0)
    missing = ServerConfig(rollout_prompts=str(tmp_path / "absent.jsonl"))
    with pytest.raises(RolloutSetupError, match="absent.jsonl"):
        RolloutServer(missing, models=models)


def test_example_trainer_records_batches_and_pushes_weights(
    models: ModelSet, files: dict[str, Path], tiny_actor_dir: Path, tmp_path: Path
) -> None:
    spec = importlib.util.spec_from_file_location("subscribe_trainer", TRAINER)
    assert spec is not None and spec.loader is not None
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    out = tmp_path / "batches.jsonl"
    with serving(models, files, rollout_epochs=0) as server:
        args = ["--target", server.address, "--name", "pusher", "--out", str(out)]
        args += ["--max-batches", "4", "--push-every", "2"]
        args += ["--weights", str(tiny_actor_dir / "model.safetensors")]
        assert trainer.main(args) == 0
        assert server.state.policy_version("actor") == 2  # pushed after batches 2 and 4
    lines = _read_lines(out)
    assert [line["batch_index"] for line in lines] == [0, 1, 2, 3]
    assert all(line["subscriber"] == "pusher" for line in lines)
    assert all(len(line["policy_versions"]) == PER_BATCH * GROUP for line in lines)


# ---- acceptance: a server process and two trainer processes -----------------------------------


def _start_waiting_server(*args: str) -> tuple[ServerProcess, str]:
    """A server process with --wait-for-weights, once it waits (start_server_process waits for
    SERVING, which such a server reports only after its first weights)."""
    workdir = Path(tempfile.mkdtemp(prefix="rollserve-rollout-"))
    port_file, log_path = workdir / "port", workdir / "server.log"
    command = [sys.executable, "-m", "rollserve.server", "serve", "--host", "127.0.0.1"]
    command += ["--port", "0", "--port-file", str(port_file), "--wait-for-weights", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSERVE_")}
    with open(log_path, "wb") as log:
        proc = ServerProcess(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log_path

    def waiting() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"server exited during start-up:\n{proc.log_text()}")
        if not port_file.exists():
            return False
        with grpc.insecure_channel(f"127.0.0.1:{int(port_file.read_text())}") as channel:
            try:
                health = rollout_pb2_grpc.RolloutStub(channel).Health(pb.HealthRequest(), timeout=5)
            except grpc.RpcError:
                return False
        return health.status == pb.SERVING_STATUS_WAITING_FOR_WEIGHTS

    try:
        _wait_until(waiting, "the server waits for its first weights")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, f"127.0.0.1:{int(port_file.read_text())}"


def _trainer(target: str, name: str, out: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, str(TRAINER), "--target", target]
    command += ["--name", name, "--out", str(out), "--timeout-s", "120", *extra]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _read_lines(path: Path) -> list[dict]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines()]


def test_two_trainer_processes_share_the_rollout_and_survive_a_kill(
    files: dict[str, Path], tiny_actor_dir: Path, tmp_path: Path
) -> None:
    epochs, kill_after = 2, 2
    # Longer responses (no EOS stop) make a batch take longer than a trainer needs to record one
    # and die, so the killed trainer has nothing in flight when it goes.
    slow = {**TEMPLATE, "sampling": {"maxNewTokens": 48, "ignoreEos": True}}
    template = _write_template(tmp_path / "request.json", slow)
    # Waiting for weights: nothing is made before both trainers are subscribed.
    proc, target = _start_waiting_server(
        "--device", "cpu", "--actor", str(tiny_actor_dir), "--metrics-port", "0",
        "--rollout-prompts", str(files["prompts"]), "--rollout-request", str(template),
        "--rollout-prompts-per-batch", str(PER_BATCH), "--rollout-epochs", str(epochs),
    )  # fmt: skip
    outs = {name: tmp_path / f"{name}.jsonl" for name in ("victim", "survivor")}
    trainers = {
        "victim": _trainer(target, "victim", outs["victim"], "--kill-after", str(kill_after)),
        "survivor": _trainer(target, "survivor", outs["survivor"]),
    }
    try:
        _wait_until(lambda: _progress(target).subscribers == 2, "both trainers subscribe")
        waiting = _progress(target)
        assert (waiting.step, waiting.batches_delivered, waiting.finished) == (0, 0, False)
        from safetensors.torch import load_file

        with RolloutClient(target) as client:  # the first weights start the rollout
            client.update_weights(load_file(tiny_actor_dir / "model.safetensors"), version=1)
        assert trainers["survivor"].wait(timeout=120) == 0, trainers["survivor"].stderr.read()
        assert trainers["victim"].wait(timeout=30) == -9  # SIGKILL
        progress = _progress(target)
    finally:
        for trainer in trainers.values():
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
        # Not asserted: the server's clean exit is test_server_process's subject (and a plain
        # server process sometimes aborts in C++ teardown after "stopped", rollout or not).
        proc.terminate_and_wait()
    victim, survivor = _read_lines(outs["victim"]), _read_lines(outs["survivor"])
    assert len(victim) == kill_after
    total = epochs * BATCHES_PER_EPOCH
    # Alternation: both were subscribed before the first batch, so the victim got every other
    # batch until it died, and the survivor everything else.
    first = victim[0]["batch_index"]
    assert first in (0, 1)
    assert [b["batch_index"] for b in victim] == [first + 2 * i for i in range(kill_after)]
    indices = sorted(b["batch_index"] for b in victim + survivor)
    assert indices == list(range(total))
    _assert_each_prompt_once_per_epoch(victim + survivor, epochs)  # none lost, none twice
    assert all(v == 1 for b in victim + survivor for v in b["policy_versions"])
    assert progress.finished
    assert (progress.step, progress.batches_delivered, progress.epoch) == (total, total, epochs - 1)
    assert progress.batches_dropped_stale == 0 and progress.subscribers == 0


def test_running_reward_moments_carry_from_batch_to_batch(models: ModelSet, tmp_path: Path) -> None:
    """With reward_running_norm the loop threads the moments as a trainer would: each batch
    starts from the moments its predecessor ended with, so the count grows by every row."""
    prompts = [{"prompt": f"q{i}=", "gt_answer": str(i)} for i in range(NUM_PROMPTS)]
    template = {
        **TEMPLATE,
        "algorithm": {"advantageEstimator": "reinforce", "rewardRunningNorm": "standardize"},
    }
    files = {
        "prompts": _write_jsonl(tmp_path / "p.jsonl", prompts),
        "request": _write_template(tmp_path / "r.json", template),
    }
    with serving(models, files) as server, RolloutClient(server.address) as client:
        batches = list(client.subscribe("moments", max_batches=3))
    counts = [
        RunningRewardMoments.from_experience(b.experience).count for b in sorted(
            batches, key=lambda b: b.batch_index
        )
    ]  # fmt: skip
    rows = PER_BATCH * GROUP
    # LightRFT's prior count is 1e-24: the count after batch k is k x rows.
    assert counts == pytest.approx([rows, 2 * rows, 3 * rows])
