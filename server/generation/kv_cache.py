"""The static KV cache: one flat buffer for every layer's K and V, sized from a token budget.

A request's layout is (rows, width): every row has `width` columns (left-padded prompt, then
the response), so a decode step writes the same column in every row. The buffer grows to
the largest layout asked for, never past the budget; the caller splits a request into
batches of at most rows_for(width) rows. Views of one buffer keep the addresses that
captured CUDA graphs read stable while the buffer lives (`generation` counts reallocations).
"""

from __future__ import annotations

import torch

from .sampler import SAMPLE_ROWS

__all__ = [
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "KVCache",
    "activation_reserve_bytes",
    "default_capacity_tokens",
]

# Without a token budget (--kv-cache-tokens 0), on CUDA: the share of the device's total memory
# that the device's use when the engine starts (the loaded weights, any other process) plus
# the KV cache may reach (--gpu-memory-utilization).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.5
# Without a token budget on the CPU (no free-memory figure to go by).
DEFAULT_CPU_BYTES = 4 << 30


# Rows of the decode step whose logits the budget keeps room for (float32 at most); the
# sampler's temporaries come on top for SAMPLE_ROWS rows at a time (~8 bytes x vocab per row:
# the float cast and the probabilities; the two-level inverse CDF adds little): together, the
# captured graphs' private pool.
RESERVE_ROWS = 512
# Scoring's lm_head chunk: its float32 block, at most this many bytes; the block's math runs in
# place (scoring._block_log_probs), so its transient is the block, plus the model-dtype logits
# it came from and one exp temporary with entropy: under 3 blocks. Fewer, larger blocks keep
# lm_head's weight reads and the kernel launches per block small next to the block's work.
SCORING_CHUNK_BYTES = 256 << 20


def activation_reserve_bytes(vocab: int) -> int:
    """What the KV budget leaves, inside the --gpu-memory-utilization share, for the device
    memory that is not KV: the decode step's graph pool at RESERVE_ROWS rows and scoring's
    lm_head chunks (scoring.py sizes its position blocks by SCORING_CHUNK_BYTES; on CUDA the
    vocabulary chunks of experience/vocab_chunks.py hold half of one); the scoring term also
    covers a full-sequence forward's attention mask (attention.MASK_BYTES at most, alive only
    while the decoder body runs, before any lm_head chunk). A server's engine adds
    one term to it (registry.staging_reserve_bytes): one device staging copy of the weights
    of each model the server updates (weights/arena.py keeps it between updates)."""
    return (4 * RESERVE_ROWS + 8 * SAMPLE_ROWS) * vocab + 3 * SCORING_CHUNK_BYTES


def default_capacity_tokens(
    token_bytes: int, device: torch.device, utilization: float, reserve_bytes: int = 0
) -> int:
    """Tokens the cache may hold without a token budget.

    On CUDA: utilization x total memory, less what is in use now and `reserve_bytes` for the
    activations of generation and scoring (activation_reserve_bytes; like vLLM's
    gpu_memory_utilization, with the activations estimated rather than profiled) plus, on a
    server, the device staging copies of weight updates; 0 when the use already reaches the
    share (generation then takes the Hugging Face path). So the KV cache, grown to its budget,
    and those reserves together stay inside the share. Elsewhere a fixed budget.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * utilization) - (total - free) - reserve_bytes
        return max(0, budget) // token_bytes
    return max(1, DEFAULT_CPU_BYTES // token_bytes)


class KVCache:
    """K and V for `layers` layers of (Hkv, D) heads, at most `capacity_tokens` tokens."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        capacity_tokens: int,
    ) -> None:
        self.shape = (layers, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.capacity_tokens = capacity_tokens
        self.token_bytes = 2 * layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
        self._buffer: torch.Tensor | None = None
        self.generation = 0  # bumps when the buffer is reallocated

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the buffer allocated now (it grows to the largest layout asked for)."""
        return 0 if self._buffer is None else self._buffer.numel() * self._buffer.element_size()

    def rows_for(self, width: int) -> int:
        """How many rows of `width` columns fit in the budget."""
        return self.capacity_tokens // width

    def grows_for(self, rows: int, width: int) -> bool:
        """Whether view(rows, width) must allocate a larger buffer (the caller drops every
        view of the old one first, so that the two never exist at once)."""
        layers, kv_heads, head_dim = self.shape
        need = 2 * layers * rows * kv_heads * width * head_dim
        return self._buffer is None or self._buffer.numel() < need

    def view(self, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views (layers, rows, Hkv, width, D) of the buffer, grown if needed."""
        if rows * width > self.capacity_tokens:
            raise ValueError(f"{rows} x {width} tokens exceed the cache ({self.capacity_tokens})")
        layers, kv_heads, head_dim = self.shape
        per_side = layers * rows * kv_heads * width * head_dim
        if self._buffer is None or self._buffer.numel() < 2 * per_side:
            self._buffer = None  # free the old buffer before allocating the larger one
            if self.device.type == "cuda":
                # Hand the old buffer's (and dropped graphs') blocks back to the device, so the
                # caching allocator does not keep every size the cache ever had reserved.
                torch.cuda.empty_cache()
            # Zeros, not empty: attention multiplies masked columns' V by a weight of 0, and
            # uninitialised memory may hold NaN (0 x NaN = NaN). Later garbage is finite.
            self._buffer = torch.zeros(2 * per_side, dtype=self.dtype, device=self.device)
            self.generation += 1
        both = self._buffer[: 2 * per_side].view(2, layers, rows, kv_heads, width, head_dim)
        return both[0], both[1]

    def release(self) -> None:
        """Free the buffer (the next view allocates again)."""
        self._buffer = None
        self.generation += 1
