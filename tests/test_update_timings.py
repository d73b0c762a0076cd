"""Per-phase timings of a weight update (server/weights/timings.py): laps in order, lanes'
seconds summed across threads, and, on a real server, one log line per update with its phases
and the rollserve_update_phase_seconds histogram, for a host arena and a pipelined one."""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path

import pytest
import torch
from helpers_weights import perturbed
from rollserve.client import RolloutClient
from rollserve.client.protocol.dtypes import SAFETENSORS_DTYPES
from rollserve.server.config import ServerConfig
from rollserve.server.models import ModelSet, load_models
from rollserve.server.models.default_model import TinyModelSpec, save_tiny_causal_lm
from rollserve.server.serving.app import RolloutServer
from rollserve.server.weights.arena import StagingArena, set_staging_arena
from rollserve.server.weights.header import StreamEntry
from rollserve.server.weights.pipeline import SlotRing
from rollserve.server.weights.timings import PHASES, UpdateTimings

WAIT_S = 30.0
SLOT_BYTES = 64 * 1024
SPEC = TinyModelSpec(hidden_size=128, intermediate_size=384)
# What every update has, whatever its plane (head and open are the planes' own).
EVERY_UPDATE = ("header", "turn", "receive", "finish", "swap_wait", "apply", "swap_return",
                "close", "reply")  # fmt: skip


def test_laps_charge_the_time_since_the_previous_lap_in_phase_order() -> None:
    timings = UpdateTimings()
    timings.lap("receive")
    timings.lap("head")
    timings.lap("receive")  # a phase that runs twice adds up
    assert list(timings.phases) == ["receive", "head"]
    assert timings.total_s == pytest.approx(sum(timings.phases.values()))
    phases = timings.line().split(" = ")[0].split()[::2]
    assert phases == ["head", "receive"]  # the line follows PHASES, not the order of laps
    assert PHASES.index("head") < PHASES.index("receive")


def test_lane_seconds_add_up_across_threads() -> None:
    timings = UpdateTimings()
    start = threading.Barrier(4)

    def lane() -> None:
        start.wait(timeout=WAIT_S)
        for _ in range(1000):
            timings.add("host_copy", 0.001)

    threads = [threading.Thread(target=lane) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert timings.counts["host_copy"] == 4000
    assert timings.lane_seconds["host_copy"] == pytest.approx(4.0)
    assert "host_copy 4.0000/4000" in timings.line()


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_causal_lm(tmp_path_factory.mktemp("timings-actor"), SPEC)


def loaded(actor_dir: Path, pipelined: bool) -> ModelSet:
    models = load_models(ServerConfig(device="cpu", actor=str(actor_dir)))
    if pipelined:  # the CUDA server's code on the CPU: a ring of small slots
        ring = SlotRing(pin_memory=False, slots=3, slot_bytes=SLOT_BYTES)
        set_staging_arena(models.actor.module, StagingArena(device="cpu", ring=ring))
    return models


def lane_count(phases: str, kind: str) -> int:
    """The count of `kind` in a phases line's lane-seconds ("kind seconds/count")."""
    return int(phases.split(f" {kind} ")[1].split()[0].split("/")[1])


def phase_lines(records: list[logging.LogRecord]) -> list[str]:
    lines = [r.getMessage() for r in records if r.name.endswith("weights.update")]
    return [line for line in lines if "; phases: " in line]


@pytest.mark.parametrize("pipelined", [False, True], ids=["host arena", "pipelined arena"])
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_every_update_logs_its_phases_and_observes_the_histogram(
    actor_dir: Path, pipelined: bool, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    models = loaded(actor_dir, pipelined)
    actor = models.actor.module
    data_bytes = sum(t.nbytes for t in actor.state_dict().values())
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", metrics_port=0)
    caplog.set_level(logging.INFO, logger="rollserve.server.weights.update")
    with RolloutServer(config, models=models) as server:
        with RolloutClient(server.address, timeout_s=WAIT_S) as client:
            for version in (1, 2):
                weights = perturbed(actor, seed=version)
                client.update_weights(weights, version=version, transport=transport, streams=1)
        registry = server.metrics.registry
        for phase in EVERY_UPDATE:
            count = registry.get_sample_value(
                "rollserve_update_phase_seconds_count", {"phase": phase}
            )
            assert count == 2, phase
    lines = phase_lines(caplog.records)
    assert len(lines) == 2
    assert "to version 2 over " + transport in lines[1]
    phases = lines[1].split("; phases: ")[1]
    named = phases.split(" = ")[0].split()[::2]
    assert set(EVERY_UPDATE) <= set(named)
    assert named == [p for p in PHASES if p in named]  # in order, none unknown
    if transport == "shm":
        assert "open" in named and "head" in named
    else:  # the stream's waits for its chunks, apart from the work on them
        assert "stream_wait" in phases
    if pipelined:
        assert "staged on the device" in lines[1]
        # Every data byte passed the ring: at least one slot per SLOT_BYTES, each counted.
        slots = int(phases.split("host_copy ")[1].split()[0].split("/")[1])
        assert slots >= data_bytes // SLOT_BYTES
        assert "ring_wait" in phases
        # The tiny model's tensors lie back to back in one dtype: one reduction checks them all.
        assert lane_count(phases, "check_group") == 1
    else:
        assert "in host memory" in lines[1]
        assert "host_copy" not in phases
    # The first update parsed and planned the head; the second sent the same one: reused.
    assert " head_check " in lines[0].split("; phases: ")[1]
    assert " head_check " not in phases


def test_a_refused_update_logs_no_phases(actor_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    models = loaded(actor_dir, pipelined=True)
    actor = models.actor.module
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", metrics_port=0)
    caplog.set_level(logging.INFO, logger="rollserve.server.weights.update")
    with RolloutServer(config, models=models) as server:
        with RolloutClient(server.address, timeout_s=WAIT_S) as client:
            bad = perturbed(actor, seed=3)
            name = next(iter(bad))
            bad[name].view(-1)[0] = torch.nan
            with pytest.raises(Exception, match="NaN or infinite"):
                client.update_weights(bad, version=1, transport="grpc", streams=1)
        count = server.metrics.registry.get_sample_value(
            "rollserve_update_phase_seconds_count", {"phase": "apply"}
        )
        assert count is None
    assert phase_lines(caplog.records) == []


# ---- the device checks of back-to-back tensors: one reduction per group ------------------------


def entries_of(specs: list[tuple[str, str, int]]) -> list[StreamEntry]:
    """StreamEntries back to back in data order from (name, safetensors dtype, elements)."""
    out, cursor = [], 0
    for name, dtype, count in specs:
        nbytes = count * SAFETENSORS_DTYPES[dtype].itemsize
        out.append(StreamEntry(name, dtype, (count,), cursor, cursor + nbytes))
        cursor += nbytes
    return out


def aminmax_calls(run: object) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        run()  # type: ignore[operator]
    return sum(1 for event in profiler.events() if event.name == "aten::aminmax")


def test_back_to_back_tensors_are_checked_by_one_reduction_and_the_first_bad_is_named() -> None:
    from rollserve.client.protocol.errors import InvalidArgument
    from rollserve.server.weights.verify import DeferredValues, ValueRule, plan_check_groups

    rule = ValueRule(check_finite=True)
    entries = entries_of([("t0", "BF16", 100), ("t1", "BF16", 300), ("t2", "BF16", 50),
                          ("t3", "BF16", 550)])  # fmt: skip
    rules = {e.name: rule for e in entries}
    groups = plan_check_groups(entries, rules, group_bytes=900)  # t2 starts below 900 bytes
    assert [g.names for g in groups] == [("t0", "t1", "t2"), ("t3",)]
    assert [(g.data_begin, g.data_end) for g in groups] == [(0, 900), (900, 2000)]
    buffer = torch.ones(1000, dtype=torch.bfloat16)
    raw = buffer.view(torch.uint8)
    deferred = DeferredValues(groups)

    def launch_all() -> None:
        for index in (1, 0):  # lanes complete groups out of order
            group = groups[index]
            deferred.launch(index, raw[group.data_begin : group.data_end])
        deferred.settle()

    assert aminmax_calls(launch_all) == 2  # one per group, not one per tensor
    buffer[150] = math.inf  # in t1
    buffer[990] = math.nan  # in t3
    for index, group in enumerate(groups):
        deferred.launch(index, raw[group.data_begin : group.data_end])
    with pytest.raises(InvalidArgument, match=r"^t1: NaN or infinite"):
        deferred.settle()
    deferred.launch(0, raw[:900])  # a group never launched is a bug, not a pass
    with pytest.raises(AssertionError, match="t3 never ran"):
        deferred.settle()


def test_groups_break_at_a_dtype_a_rule_a_gap_or_their_size() -> None:
    from rollserve.server.weights.verify import ValueRule, plan_check_groups

    strict, loose = ValueRule(check_finite=True), ValueRule(check_finite=True, max_abs=100.0)
    entries = entries_of([("a", "F16", 256), ("b", "F16", 256), ("c", "F32", 256),
                          ("skipped", "I32", 1), ("d", "F32", 255), ("empty", "F32", 0),
                          ("e", "F32", 10), ("f", "BOOL", 3), ("g", "BOOL", 5)])  # fmt: skip
    rules = {e.name: loose for e in entries} | {"a": strict, "skipped": ValueRule(False)}
    groups = plan_check_groups(entries, rules)
    # a: its rule; b: the dtype after it; an int32 needs no check, and its bytes are a gap; an
    # empty tensor is skipped without breaking the run; bools are a dtype of their own.
    assert [g.names for g in groups] == [("a",), ("b",), ("c",), ("d", "e"), ("f", "g")]
    assert groups[3].sizes == (1020, 40) and groups[4].dtype == torch.bool
    assert [g.names for g in plan_check_groups(entries, rules, group_bytes=0)] == [
        ("a",), ("b",), ("c",), ("d",), ("e",), ("f",), ("g",)]  # fmt: skip
    no_checks = {e.name: ValueRule(False) for e in entries}  # allow_non_finite: bools only
    assert [g.names for g in plan_check_groups(entries, no_checks)] == [("f", "g")]


# ---- on a CUDA device (marked gpu: skipped without CUDA) ---------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_a_cuda_server_logs_device_phases_with_one_check_per_group(
    actor_dir: Path, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = ServerConfig(host="127.0.0.1", port=0, device="cuda", dtype="bfloat16",
                          metrics_port=0, actor=str(actor_dir),
                          generation_path="hf")  # fmt: skip
    models = load_models(config)
    actor = models.actor.module
    tensors = len(actor.state_dict())
    caplog.set_level(logging.INFO, logger="rollserve.server.weights.update")
    with RolloutServer(config, models=models) as server:
        with RolloutClient(server.address, timeout_s=WAIT_S) as client:
            for version in (1, 2):
                weights = {
                    k: v.detach().cpu() + 0.01 * version for k, v in actor.state_dict().items()
                }
                client.update_weights(weights, version=version, transport=transport, streams=1)
    lines = phase_lines(caplog.records)
    assert len(lines) == 2 and "staged on the device" in lines[1]
    phases = lines[1].split("; phases: ")[1]
    # The server's weights lie in one buffer in the file's order (models/memory.py), as the
    # device arena's staged tensors do: the apply is one copy of them all (copy_runs.py).
    assert tensors > 1 and lane_count(phases, "apply_launch") == 1
    # The tiny model's tensors lie back to back in one dtype: one reduction checks them all.
    assert lane_count(phases, "check_group") == 1
    if transport == "shm":  # the page-locked mapping is copied to the device, no host copy
        assert lane_count(phases, "page_lock") == 1 and lane_count(phases, "copy_launch") >= 1
        assert " host_copy " not in phases
    else:  # bytes from the socket go through the pinned ring
        assert lane_count(phases, "host_copy") >= 1 and " ring_wait " in phases
