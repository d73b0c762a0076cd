"""The server's streaming path of MakeExperience: device tensors to the host, and the same
tensors over gRPC as in-process.

On the CPU the host copies are the tensors themselves; on CUDA (gpu tests) they are pinned
copies made without a wait per tensor, equal bit for bit to `.cpu()`, and a CUDA server streams
exactly what its maker returns in-process.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from rollserve.client.client import RolloutClient
from rollserve.client.protocol.experience import EXPERIENCE_TENSOR_FIELDS, Experience
from rollserve.server.config import ServerConfig
from rollserve.server.experience.batches import fetch_to_cpu
from rollserve.server.models import load_models
from rollserve.server.serving.app import RolloutServer

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [40], [70, 71]]
# Three generation batches and micro-batches that straddle them: every streaming branch.
REQUEST = dict(
    samples_per_prompt=2,
    max_new_tokens=8,
    seed=11,
    algorithm={"advantage_estimator": "group_norm"},
    rewards=["exact_match"],
    gt_answers=["a", "b", "c", "d"],
    generate_batch_size=2,
    micro_batch_size=4,
    return_entropy=True,
    return_texts=True,
)


def assert_identical(a: Experience, b: Experience) -> None:
    """Every tensor equal bit for bit (wall-clock timings aside), same dtypes and texts."""
    for name in EXPERIENCE_TENSOR_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name
    timings = {key for key in a.info if key.startswith("time/")}
    assert set(a.info) == set(b.info)
    for key in set(a.info) - timings:
        assert torch.equal(a.info[key], b.info[key]), key
    assert a.response_texts == b.response_texts


def test_cpu_tensors_come_back_as_they_are() -> None:
    tensor = torch.arange(6, dtype=torch.float32).view(2, 3).requires_grad_()
    view = torch.arange(12).view(3, 4)[:, 1:3]  # not contiguous: kept as it is
    host = fetch_to_cpu({"a": tensor, "b": None, "c": view})
    assert host["b"] is None
    assert host["a"].data_ptr() == tensor.data_ptr() and not host["a"].requires_grad
    assert host["c"].data_ptr() == view.data_ptr() and host["c"].stride() == view.stride()


@pytest.mark.gpu
def test_cuda_tensors_arrive_pinned_and_equal_to_cpu() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {
        "float32": torch.randn(64, 33, device="cuda", generator=g),
        "bfloat16": torch.randn(5, 7, device="cuda", generator=g).bfloat16(),
        "int64": torch.randint(0, 1 << 40, (9, 300), device="cuda", generator=g),
        "bool": torch.rand(4, 11, device="cuda", generator=g) > 0.5,
        "strided": torch.randn(16, 40, device="cuda", generator=g)[:, 3:29:2],
        "empty": torch.empty(0, 8, device="cuda"),
        "none": None,
    }
    # Queue a long kernel first, so a copy that did not wait for its producer would show.
    late = torch.randn(4096, 4096, device="cuda", generator=g)
    tensors["late"] = (late @ late).sum(0)
    host = fetch_to_cpu(tensors)
    for name, tensor in tensors.items():
        if tensor is None:
            assert host[name] is None
            continue
        got = host[name]
        # An empty tensor has no storage to pin (torch returns it unpinned); nothing to copy.
        assert got.device.type == "cpu" and (got.is_pinned() or got.numel() == 0), name
        assert got.dtype == tensor.dtype and torch.equal(got, tensor.cpu()), name


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def served(request, tiny_actor_dir) -> Iterator[RolloutServer]:
    config = ServerConfig(
        host="127.0.0.1", port=0, actor=str(tiny_actor_dir), device=request.param,
        log_level="WARNING", metrics_port=0,
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        # On CUDA: the engine with its graphs, uncompiled to keep the test short.
        patch.setenv("ROLLSERVE_ENGINE_COMPILE", "0")
        with RolloutServer(config, models=load_models(config)) as server:
            yield server


def test_a_server_streams_what_its_maker_makes_in_process(served: RolloutServer) -> None:
    maker = served.runtime.maker
    if maker.models.device.type == "cuda":  # the first call of a shape builds its graphs
        maker.make_experience(PROMPTS, **REQUEST)
    local = maker.make_experience(PROMPTS, **REQUEST)
    with RolloutClient(served.address, timeout_s=120) as client:
        remote = client.make_experience(PROMPTS, **REQUEST)
        streamed = list(client.stream_experience(PROMPTS, **REQUEST))
    assert_identical(local, remote)
    assert [e.num_rows for e in streamed] == [4, 4]
    assert torch.equal(torch.cat([e.prompt_index for e in streamed]), local.prompt_index)
    if torch.cuda.is_available():  # the client lands it ready for a non-blocking copy
        assert remote.sequences.is_pinned()
