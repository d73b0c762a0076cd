"""Per-phase timings of a weight update (server/weights/timings.py): laps in order, lanes'
seconds summed across threads, and, on a real server, one log line per update with its phases
and the rollserve_update_phase_seconds histogram, for a host arena and a pipelined one."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
from helpers_weights import perturbed
from rollserve.client import RolloutClient
from rollserve.server.config import ServerConfig
from rollserve.server.models import ModelSet, load_models
from rollserve.server.models.default_model import TinyModelSpec, save_tiny_causal_lm
from rollserve.server.serving.app import RolloutServer
from rollserve.server.weights.arena import StagingArena, set_staging_arena
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
    if pipelined:
        assert "staged on the device" in lines[1]
        # Every data byte passed the ring: at least one slot per SLOT_BYTES, each counted.
        slots = int(phases.split("host_copy ")[1].split()[0].split("/")[1])
        assert slots >= data_bytes // SLOT_BYTES
        assert "check_launch" in phases and "ring_wait" in phases
    else:
        assert "in host memory" in lines[1]
        assert "host_copy" not in phases


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
