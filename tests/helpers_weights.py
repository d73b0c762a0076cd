"""The UpdateWeights request stream as protobuf messages, for tests that need message objects.

The library builds one stream, the encoded bytes of `update_weights_messages`; a test that edits
messages (a corrupt CRC, a truncated stream), feeds the server's staging directly, or plays a
plain protobuf client with the generated stub parses those bytes with protobuf's own parser
here. There is no second builder to drift from the first, and every such test also checks that
the hand-encoded bytes are valid protobuf.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping

import torch
from rollserve.client.weights.update_file import update_weights_messages
from rollserve.v1 import rollout_pb2 as pb

__all__ = ["perturbed", "state_hash", "update_weights_requests"]


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


def perturbed(module: torch.nn.Module, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A trainer-side state dict: every floating tensor moved by seeded noise."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: tensor + scale * torch.randn(tensor.shape, generator=generator)
        if tensor.is_floating_point()
        else tensor.clone()
        for name, tensor in module.state_dict().items()
    }
