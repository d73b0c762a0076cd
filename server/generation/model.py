"""The forward of a Llama-family model over the HF module's own parameters.

Prefill runs left-padded prompts (b, s) against themselves and hands each layer's K/V to the
caller (which writes them into the static cache); decode runs one token per row against the
cache. Both follow the HF modules' arithmetic step for step (RMSNorm in float32, RoPE in the
model dtype), so logits agree with the HF forward to rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .attention import decode_attention, prefill_attention, prefill_mask
from .families import Family, Layer
from .rotary import RopeTable, apply_rope

__all__ = ["Forward", "rms_norm"]

# Receives (layer index, k, v), each (b, Hkv, s, D), during prefill.
KVWriter = Callable[[int, torch.Tensor, torch.Tensor], None]


def rms_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in float32, cast back, scale by the module's weight."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return module.weight * h.to(dtype)


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


class Forward:
    """Embedding -> decoder layers -> final norm -> lm_head, reading `family`'s modules."""

    def __init__(self, family: Family, rope: RopeTable) -> None:
        self.family = family
        self.rope = rope

    def _heads(
        self, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed input (b, s, hidden) -> q (b, H, s, D), k and v (b, Hkv, s, D), RoPE applied."""
        f = self.family
        b, s, _ = x.shape
        q = _linear(layer.q_proj, x).view(b, s, f.num_heads, f.head_dim)
        k = _linear(layer.k_proj, x).view(b, s, f.num_kv_heads, f.head_dim)
        v = _linear(layer.v_proj, x).view(b, s, f.num_kv_heads, f.head_dim)
        if layer.q_norm is not None:
            q = rms_norm(layer.q_norm, q)
        if layer.k_norm is not None:
            k = rms_norm(layer.k_norm, k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _mlp(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(layer.post_norm, x)
        return x + _linear(
            layer.down_proj, F.silu(_linear(layer.gate_proj, h)) * _linear(layer.up_proj, h)
        )

    def prefill(
        self,
        ids: torch.Tensor,
        valid: torch.Tensor,
        positions: torch.Tensor,
        write: KVWriter,
    ) -> torch.Tensor:
        """Final-normed hidden states (b, s, hidden) of left-padded prompts ids (b, s).

        valid (b, s) bool marks real tokens; positions (b, s) are their position ids.
        """
        f = self.family
        x = F.embedding(ids, f.embed.weight)
        cos, sin = self.rope.at(positions)  # (b, s, D)
        masks = {w: prefill_mask(valid, w) for w in {layer.window for layer in f.layers}}
        for index, layer in enumerate(f.layers):
            q, k, v = self._heads(layer, rms_norm(layer.input_norm, x), cos, sin)
            write(index, k, v)
            out = prefill_attention(q, k, v, masks[layer.window], f.scaling)  # (b, H, s, D)
            x = x + _linear(layer.o_proj, out.transpose(1, 2).reshape(*ids.shape, -1))
            x = self._mlp(layer, x)
        return rms_norm(f.norm, x)

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        column: torch.Tensor,
        caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        valid: torch.Tensor,
    ) -> torch.Tensor:
        """Logits (b, V) of one token per row.

        tokens, positions (b,); column (1,) int64: the cache column this token is written to
        (the same for every row in the left-padded layout); caches: per layer k and v views
        (b, Hkv, w, D); valid (b, w) bool: the columns each row attends to (this one included).
        """
        f = self.family
        b = tokens.shape[0]
        x = F.embedding(tokens, f.embed.weight)[:, None]  # (b, 1, hidden)
        cos, sin = self.rope.at(positions[:, None])  # (b, 1, D)
        masks = {None: valid}
        columns = torch.arange(valid.shape[1], device=valid.device)
        for window in {layer.window for layer in f.layers} - {None}:
            masks[window] = valid & (columns > column - window)[None]
        for (k_cache, v_cache), layer in zip(caches, f.layers, strict=True):
            q, k, v = self._heads(layer, rms_norm(layer.input_norm, x), cos, sin)
            k_cache.index_copy_(2, column, k)
            v_cache.index_copy_(2, column, v)
            out = decode_attention(q[:, :, 0], k_cache, v_cache, masks[layer.window], f.scaling)
            x = x + _linear(layer.o_proj, out.reshape(b, 1, -1))
            x = self._mlp(layer, x)
        return self.logits(rms_norm(f.norm, x[:, 0]))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over final-normed hidden states (..., hidden) -> (..., V)."""
        return _linear(self.family.lm_head, hidden)
