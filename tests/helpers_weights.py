"""The UpdateWeights request stream as protobuf messages, and the server's update path around a
bare module, for tests that need message objects or no server.

The library builds one stream, the encoded bytes of `update_weights_messages`; a test that edits
messages (a corrupt CRC, a truncated stream), feeds the server's update path directly, or plays a
plain protobuf client with the generated stub parses those bytes with protobuf's own parser
here. There is no second builder to drift from the first, and every such test also checks that
the hand-encoded bytes are valid protobuf.

`update_in_place` runs the server's own UpdateWeights state machine (weights/update.py: header,
target and version checks, staging into the model's arena, verification, apply) on a module,
with the swap run inline instead of on an engine thread.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping

import pytest
import torch
from rollserve.client.weights.update_file import update_weights_messages
from rollserve.server.config import ServerConfig
from rollserve.server.state import ServerState
from rollserve.server.weights import DEFAULT_MAX_HEADER_BYTES, Planes, WeightUpdates
from rollserve.v1 import rollout_pb2 as pb

__all__ = [
    "calls_checked",
    "in_place_updates",
    "tiny_llama",
    "perturbed",
    "state_hash",
    "update_in_place",
    "update_weights_requests",
]


def calls_checked(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The calls the server's updates hand update.check_call from now on (an update is applied
    only while its gRPC call is alive), in order; check_call still runs."""
    from rollserve.server.weights import update as update_module

    calls: list[object] = []
    check_call = update_module.check_call
    monkeypatch.setattr(
        update_module,
        "check_call",
        lambda call, in_place: (calls.append(call), check_call(call, in_place)),
    )
    return calls


def update_weights_requests(
    weights: Mapping[str, torch.Tensor] | torch.nn.Module, **options: object
) -> Iterator[pb.UpdateWeightsRequest]:
    """update_weights_messages(weights, **options), each message parsed by protobuf.

    Arguments are validated before the first message, as update_weights_messages does.
    """
    return map(pb.UpdateWeightsRequest.FromString, update_weights_messages(weights, **options))


def state_hash(module: torch.nn.Module) -> str:
    """SHA-256 of every name and every byte of the module's state dict."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()


def weights_and_version(module: torch.nn.Module, client: object) -> tuple[str, int]:
    """The served actor's weights (state_hash of `module`) and its version (the client's
    Health): two equal snapshots say a refused update changed nothing."""
    return state_hash(module), client.health().policy_version


def perturbed(module: torch.nn.Module, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A trainer-side state dict: every floating tensor moved by seeded noise."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + scale * torch.randn(tensor.shape, generator=generator)
        if tensor.is_floating_point()
        else tensor.clone()
        for name, tensor in module.state_dict().items()
    }


def in_place_updates(
    model: torch.nn.Module,
    *,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    before_apply: Callable[[], object] | None = None,
) -> WeightUpdates:
    """The server's updater with `model` as its actor, versions from 0, chunks on the stream as
    the only plane; the swap calls `before_apply()` (a test's look at the model between staging
    and apply), then applies, on the caller's thread."""

    def swap(role: str, apply: Callable[[], object]) -> object:
        if before_apply is not None:
            before_apply()
        return apply()

    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    planes = Planes("grpc", device)
    state = ServerState(ServerConfig())
    return WeightUpdates({"actor": model}, state, planes, swap, max_header_bytes=max_header_bytes)


def update_in_place(
    model: torch.nn.Module, requests: Iterable[pb.UpdateWeightsRequest], **options: object
) -> pb.UpdateWeightsResponse:
    """One update of `model` through `in_place_updates(model, **options)`; its reply."""
    return in_place_updates(model, **options).update(iter(requests))


def tiny_llama(seed: int) -> torch.nn.Module:
    """A random 2-layer Llama (untied lm_head, grouped KV heads), seeded: the weights tests'
    sender and receiver."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def stand_in_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """export_cuda_ipc on CPU tensors: what it asks of CUDA (the device check, the sync, the
    GPU's UUID, torch's `_share_cuda_`) answered without a GPU; the spans, buffers and what
    the export holds are computed as for CUDA tensors (the gpu tests export real ones)."""
    from rollserve.client.weights import cuda_ipc as client_ipc

    monkeypatch.setattr(client_ipc, "check_on_cuda", lambda state_dict: None)
    monkeypatch.setattr(client_ipc.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(client_ipc, "device_uuid", lambda device: "0" * 32)
    monkeypatch.setattr(
        client_ipc,
        "_shared",
        lambda storage, uuid: pb.CudaIpcBuffer(device_uuid=uuid, storage_bytes=storage.nbytes()),
    )
