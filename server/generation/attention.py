"""Grouped-query attention for prefill (prompt against itself) and decode (one token against
the static KV cache), by scaled_dot_product_attention with boolean masks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["additive_mask", "decode_attention", "prefill_attention", "prefill_mask"]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive one SDPA turns it into (0 where allowed, -inf elsewhere),
    made once per forward or step: given a bool mask, SDPA converts it in every layer (two
    kernels and a mask-sized tensor per layer and step)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def prefill_mask(valid: torch.Tensor, window: int | None, first_query: int = 0) -> torch.Tensor:
    """(b, 1, s - first_query, s) bool: queries at columns first_query .. s - 1 against every
    column: causal, real keys only, within the sliding window when set.

    As HF's mask for a padded batch: a query attends to the real keys at or before it, so a
    right-pad query (scoring's rows end in pads) sees the real tokens before it, as in HF. A
    query with no real key at all (a left pad) sees only itself, so its softmax is finite; its
    output is never read (real queries never attend to a pad column).
    """
    s = valid.shape[1]
    keys = torch.arange(s, device=valid.device)
    queries = keys[first_query:]
    allowed = keys[None, :] <= queries[:, None]  # (q, s) causal
    if window is not None:
        allowed = allowed & (keys[None, :] > queries[:, None] - window)
    mask = allowed[None] & valid[:, None, :]  # (b, q, s)
    alone = ~mask.any(-1, keepdim=True)  # (b, q, 1): queries with no real key
    mask = mask | (alone & (keys[None, :] == queries[:, None])[None])
    return mask[:, None]


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q (b, H, q, D), k/v (b, Hkv, s, D), mask (b, 1, q, s) -> (b, H, q, D)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # as HF's repeat_kv: prefill runs once per request
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per row: q (b, H, D), cache k/v (b, Hkv, w, D), mask (b, w) -> (b, H, D).

    The query heads of a KV head become that head's "query positions" (b, Hkv, G, D), so
    the cache is read once per KV head and never repeated.
    """
    b, heads, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.view(b, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask[:, None, None], scale=scale)
    return out.reshape(b, heads, dim)
