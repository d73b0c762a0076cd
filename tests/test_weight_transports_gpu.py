"""GPU data planes (marked `gpu`: skipped without CUDA; `make test-gpu` runs them): shared memory
and gloo into a CUDA server (staged on its device through a pinned ring, applied device to
device: weights/pipeline.py), and NCCL between two GPUs (received straight into the device
arena)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from rollserve.client import RolloutClient, WeightsGroup
from rollserve.server.config import ServerConfig
from rollserve.server.models import load_models
from rollserve.server.models.default_model import TinyModelSpec, save_tiny_causal_lm
from rollserve.server.serving.app import RolloutServer

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
WAIT_S = 60.0


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_causal_lm(tmp_path_factory.mktemp("gpu-actor"), TinyModelSpec())


def _server(actor_dir: Path, device: str, dtype: str) -> RolloutServer:
    config = ServerConfig(host="127.0.0.1", port=0, device=device, dtype=dtype, metrics_port=0,
                          actor=str(actor_dir))  # fmt: skip
    return RolloutServer(config, models=load_models(config))


def _trainer_weights(server: RolloutServer, device: str) -> dict[str, torch.Tensor]:
    actor = server.state.models.actor.module
    generator = torch.Generator().manual_seed(5)
    return {name: (t.float().cpu() + 0.05 * torch.randn(t.shape, generator=generator)).to(device)
            for name, t in actor.state_dict().items()}  # fmt: skip


@pytest.fixture
def cuda_server(actor_dir: Path) -> Iterator[RolloutServer]:
    with _server(actor_dir, "cuda", "bfloat16") as server:
        yield server


@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_cuda_tensors_reach_a_bf16_cuda_server(cuda_server: RolloutServer, transport: str) -> None:
    weights = _trainer_weights(cuda_server, "cuda")
    with RolloutClient(cuda_server.address, timeout_s=WAIT_S) as client:
        if transport == "dist":
            # Gloo broadcasts host buckets: the trainer's CUDA tensors are copied into them.
            with WeightsGroup([client], backend="gloo") as group:
                result = client.update_weights(weights, version=1, group=group)
        else:
            result = client.update_weights(weights, version=1, transport="shm")
    assert (result.version, result.transport) == (1, transport)
    served = cuda_server.state.models.actor.module.state_dict()
    for name, tensor in weights.items():
        torch.testing.assert_close(served[name].float(), tensor.to(torch.bfloat16).float())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank")
def test_nccl_broadcast_from_the_trainers_gpu(actor_dir: Path) -> None:
    with _server(actor_dir, "cuda:1", "float32") as server:
        weights = _trainer_weights(server, "cuda:0")
        with RolloutClient(server.address, timeout_s=WAIT_S) as client:
            torch.cuda.set_device(0)
            with WeightsGroup([client], backend="nccl") as group:
                result = client.update_weights(weights, version=1, group=group)
                assert (result.version, result.transport) == (1, "dist")
                # Flattened on the GPU (like FSDP's flat parameters): plain slices of one run.
                weights = {name: tensor * 2 for name, tensor in weights.items()}
                group.flatten_weights(weights)
                result = client.update_weights(weights, version=2, group=group)
        assert (result.version, result.transport) == (2, "dist")
        served = server.state.models.actor.module.state_dict()
        for name, tensor in weights.items():
            assert torch.equal(served[name].cpu(), tensor.cpu()), name
