"""The forward of a Llama-family model over the HF module's own parameters.

Prefill runs left-padded prompts (b, s) against themselves and hands each layer's K/V to the
caller (which writes them into the static cache); decode runs one token per row against the
cache; `hidden_states` is the same full-sequence forward without a cache, over rows padded on
both sides (scoring's layout), for the teacher-forced scoring of every model on the engine.
A full-sequence forward's attention is causal with no mask over rows rolled to put their real
tokens first where its rows are long (causal_rows.py), masked otherwise (attention.py).
All follow the HF modules' arithmetic step for step (RMSNorm in float32, RoPE in the model
dtype), so logits agree with the HF forward to rounding.

A layer is two pure functions of tensors around the attention: `token_inputs` (norm,
q/k/v projections, q/k norms, RoPE) and `mlp_block` (output projection, residual, norm,
SwiGLU, residual). On CUDA they run compiled (torch.compile fuses their element-wise work into
a few kernels; a decode step is otherwise bound by ~45 small kernels per layer, a scoring
forward by its element-wise passes): for the decode step's static shapes, and for the
full-sequence forward (prefill, scoring) over one row of all its tokens, the token count
dynamic.
The cache writes and the attention stay outside, so the compiler never sees a mutation of the
cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .attention import (
    DEFAULT_DECODE_ATTENTION,
    PrefillMasks,
    additive_mask,
    decode_attention_variant,
    equal_parts,
    prefill_attention,
    prefill_backend,
    prefill_backends,
    repeat_kv,
)
from .causal_rows import CausalRows, SharedPrompts, causal_attention, causal_layout
from .compiling import full_sequence_options, maybe_compiled
from .families import Family, Layer
from .fused import FusedProjection, Linear, fuse
from .rotary import RopeTable, apply_rope
from .shared_prefix import SharedPrefix, shared_prefix_attention

__all__ = ["Forward", "mlp_block", "project", "rms_norm", "token_inputs"]

# Receives (layer index, k, v), each (b, Hkv, s, D), during prefill.
KVWriter = Callable[[int, torch.Tensor, torch.Tensor], None]
# A full-sequence forward's attention of one layer: token-major q (T, H, D), k and v
# (T, Hkv, D) -> its output (T, H * D), token-major.
Attend = Callable[[Layer, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rms_norm(weight: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in float32, cast back, scale by the weight."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def project(
    h: torch.Tensor, linears: tuple[Linear, ...], sizes: tuple[int, ...]
) -> tuple[torch.Tensor, ...]:
    """The outputs of projections with `sizes` output features over h: one F.linear per
    (weight, bias) in `linears`, or, when it holds one for all of them (fused.py), one F.linear
    split into their column blocks (views)."""
    if len(linears) == len(sizes):
        return tuple(F.linear(h, *linear) for linear in linears)
    return F.linear(h, *linears[0]).split(sizes, dim=-1)


def token_inputs(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm: tuple[torch.Tensor, float],
    qkv: tuple[Linear, ...],
    qkv_sizes: tuple[int, int, int],
    q_norm: tuple[torch.Tensor, float] | None,
    k_norm: tuple[torch.Tensor, float] | None,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual stream x (b, s, hidden) -> q (b, s, H, D), k and v (b, s, Hkv, D), RoPE'd, in
    the projections' token-major layout.

    norm, q_norm, k_norm: (weight, eps); qkv: the q, k and v projections' (weight, bias), or
    one for all three (`project`), of qkv_sizes output features.
    """
    b, s, _ = x.shape
    h = rms_norm(*norm, x)
    q_out, k_out, v_out = (t.view(b, s, -1, head_dim) for t in project(h, qkv, qkv_sizes))
    if q_norm is not None:
        q_out = rms_norm(*q_norm, q_out)
    if k_norm is not None:
        k_out = rms_norm(*k_norm, k_out)
    return apply_rope(q_out, cos, sin), apply_rope(k_out, cos, sin), v_out


def mlp_block(
    x: torch.Tensor,
    attended: torch.Tensor,
    o: Linear,
    norm: tuple[torch.Tensor, float],
    gate_up: tuple[Linear, ...],
    gate_up_sizes: tuple[int, int],
    down: Linear,
    chunks: int = 1,
) -> torch.Tensor:
    """x + o_proj(attended), then + the SwiGLU MLP of its norm; x (..., hidden), attended
    (..., H * D): per token, for any leading dimensions. gate_up: the gate and up projections,
    or one for both (`project`). chunks > 1: the SwiGLU, whose (tokens, intermediate)
    temporaries are a layer's largest, in that many equal slices of the first dimension, one
    after another (`mlp_chunks`); the output projection, residual and norm over all at once."""
    x = x + F.linear(attended, *o)
    h = rms_norm(*norm, x)
    if chunks == 1:
        return _swiglu_residual(x, h, gate_up, gate_up_sizes, down)
    return torch.cat([_swiglu_residual(x[a:b], h[a:b], gate_up, gate_up_sizes, down)
                      for a, b in equal_parts(x.shape[0], chunks)])  # fmt: skip


def _swiglu_residual(
    x: torch.Tensor,
    h: torch.Tensor,
    gate_up: tuple[Linear, ...],
    gate_up_sizes: tuple[int, int],
    down: Linear,
) -> torch.Tensor:
    """x + the SwiGLU MLP of h (x's post-attention norm)."""
    gate, up = project(h, gate_up, gate_up_sizes)
    return x + F.linear(F.silu(gate) * up, *down)


# The decode step's token_inputs and mlp_block, under code objects of their own: torch.compile
# keeps compiled code and the sizes it has seen per code object, so the step's static shapes
# do not share them with the full-sequence forward's dynamic ones.
def decode_inputs(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return token_inputs(*args)


def decode_mlp(*args: Any) -> torch.Tensor:
    return mlp_block(*args)


def _wb(module: torch.nn.Linear) -> Linear:
    return module.weight, module.bias


def _we(module: torch.nn.Module | None) -> tuple[torch.Tensor, float] | None:
    return None if module is None else (module.weight, module.variance_epsilon)


# Tokens whose MLP runs at once in a full-sequence forward (prefill, scoring): its three
# (tokens, intermediate) temporaries are the forward's largest, ~0.7 GB for scoring's forward
# batch of 64 rows x 384 columns of a Qwen2-0.5B-shaped model (intermediate 4864, bfloat16),
# which set the server's transient peak on the H100 (bench/RESULTS.md). The MLP is per token,
# so chunks of tokens give the same numbers; 4096 bounds them at ~120 MB there, and a chunk
# is still a large matmul.
MLP_CHUNK_TOKENS = 4096
# Chunks one call of the MLP function (`mlp_chunks`) runs one after another (Inductor keeps
# each chunk's wide temporaries apart: allocated and freed per chunk). A call of a compiled
# function costs the host its guards and its wrapper; with a call per chunk, a scoring forward
# batch of that model made ~7 calls a layer (~170 a batch) and was host-bound on an H200
# (kernels ~42 of its 59 ms). On this project's 2-core CPU, a 24-layer tiny model with the
# same call structure (bench/RESULTS.md, session of 2026-11-27 14:40): a call per chunk 72-78
# ms a forward (median), 8 chunks a call 51 ms. 8 covers a forward batch of 64 rows x 512
# columns in one call a layer.
MLP_CALL_CHUNKS = 8


def mlp_chunks(*args: Any) -> torch.Tensor:
    """mlp_block over (tokens, ...) inputs (its arguments) with the SwiGLU in MLP_CALL_CHUNKS
    equal slices of tokens, so that only one slice's temporaries exist at a time. Compiled, a
    chunk is three kernels (gate/up GEMM, SwiGLU, down GEMM with the residual; the output
    projection and the norm, once for all tokens, were a GEMM and a kernel a chunk before): a
    compiled call's host time is its kernel launches, and a scoring forward batch is
    host-bound on an H200. tokens >= 2 * MLP_CALL_CHUNKS: compiled with dynamic shapes, a
    slice of 0 or 1 token is specialised (a new graph)."""
    return mlp_block(*args, chunks=MLP_CALL_CHUNKS)


# The full-sequence functions (prefill, scoring) under code objects of their own for Inductor's
# C++ wrapper (compiling.full_sequence_options): torch.compile keeps one backend's code per code
# object, so a process that builds forwards both ways would otherwise compile again at every
# switch.
def cpp_token_inputs(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return token_inputs(*args)


def cpp_mlp_chunks(*args: Any) -> torch.Tensor:
    return mlp_chunks(*args)


def _at_least(t: torch.Tensor, dim: int, least: int = 2) -> torch.Tensor:
    """t with a `dim` of fewer than `least` (default 2) entries repeated up to `least` or more
    (the caller keeps the first results): compiled with dynamic shapes, a size of 1 is
    specialised, and would compile again on the request path."""
    size = t.shape[dim]
    if size >= least:
        return t
    times = -(-least // size)
    return t.repeat(*(times if d == dim else 1 for d in range(t.dim())))


def _by_row(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Token-major (rows * s, heads, D) -> (rows, heads, s, D), a heads-first view."""
    return t.view(rows, -1, *t.shape[1:]).transpose(1, 2)


def _tokens_vary(dim: int, *tensors: torch.Tensor) -> None:
    """Mark the token dimension `dim` of a compiled full-sequence call's activations dynamic:
    one code serves every token count, while the rest (hidden and head sizes, head_dim, the
    weights' shapes) stays constants. Compiled with dynamic=True, every size was symbolic:
    each elementwise kernel split its flat index by runtime sizes (integer divisions per
    element), and a 0.5B layer's RMSNorm and RoPE took 2.3x as long on a CPU (9.1 against 3.9
    ms a call of 1,536 tokens; the H200 profile had the RoPE kernel at ~5x its bytes).
    maybe_: a size a lowering must specialise compiles again rather than fails."""
    for tensor in tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


class Forward:
    """Embedding -> decoder layers -> final norm -> lm_head, reading `family`'s modules.

    compiled: run the per-layer functions through torch.compile (the engine: on CUDA), the
    decode step's for its static shapes, the full-sequence forward's for any token count.
    fused: run each layer's q/k/v and gate/up projections as one GEMM each, over fused weights
    whose blocks the modules' parameters become (fused.py; the engine: on CUDA).
    decode_attention_variant: which of attention.py's DECODE_ATTENTION decode runs (the engine
    picks it at warm-up, before it captures graphs: a captured graph keeps the one it saw).
    """

    def __init__(
        self, family: Family, rope: RopeTable, *, compiled: bool = False, fused: bool = False
    ) -> None:
        self.family = family
        self.rope = rope
        # id(layer) -> its q/k/v and gate/up projections as one GEMM each (fused.py), where
        # they can be one; the modules' parameters become views of the fused weights.
        self._fused: dict[int, tuple[FusedProjection | None, FusedProjection | None]] = {}
        if fused:
            for layer in family.layers:
                self._fused[id(layer)] = (
                    fuse((layer.q_proj, layer.k_proj, layer.v_proj)),
                    fuse((layer.gate_proj, layer.up_proj)),
                )
        self._inputs = maybe_compiled(decode_inputs, compiled)
        self._mlp = maybe_compiled(decode_mlp, compiled)
        # The full-sequence forward's (prefill, scoring) on one row of all its tokens, so the
        # compiled code varies in one size (the token count, marked dynamic at each call:
        # `_tokens_vary`) and is built once, by the warm-up's scoring batch: eager, its
        # RMSNorms, RoPE, SwiGLU and residuals are ~40 % of a scoring forward batch's time on
        # an H100 (bench/RESULTS.md, 16:31 profile).
        options = (  # ROLLSERVE_ENGINE_CPP_WRAPPER
            full_sequence_options(family.embed.weight.device) if compiled else None
        )
        inputs_fn, mlp_fn = (
            (cpp_token_inputs, cpp_mlp_chunks) if options else (token_inputs, mlp_chunks)
        )
        self._token_inputs = maybe_compiled(inputs_fn, compiled, options=options)
        # Compiled, the MLP runs MLP_CALL_CHUNKS token chunks a call (a call is host time);
        # eager, a call per chunk: eager ops cost the same however they are grouped, and more
        # chunks than the memory bound needs are only more of them (a small CPU forward took
        # twice as long in 8 chunks).
        self._token_mlp = (
            maybe_compiled(mlp_fn, compiled, options=options) if compiled else mlp_block
        )
        self.decode_attention_variant = DEFAULT_DECODE_ATTENTION
        # The attention decode runs for grouped rows (decode's `shared`): a name of
        # shared_prefix.SHARED_PREFIX_ATTENTION, compiled where the layers are.
        self.shared_attention_variant = "matmul_shared"
        self._compiled = compiled
        self.prefill_backend = prefill_backend()  # ROLLSERVE_PREFILL_ATTENTION, read once

    @property
    def compiled(self) -> bool:
        """Whether the layer functions run through torch.compile (the engine on CUDA)."""
        return self._compiled

    @property
    def runs_compiled(self) -> bool:
        """compiled, and neither full-sequence function (prefill, scoring) has turned eager
        after a compiler failure (compiling.maybe_compiled's fallback)."""
        functions = (self._token_inputs, self._token_mlp)
        return self._compiled and all(getattr(f, "compiled", None) is not None for f in functions)

    @property
    def decode_attention_variant(self) -> str:
        """The name decode's attention runs; setting a name not in DECODE_ATTENTION raises
        ValueError."""
        return self._decode_attention_name

    @decode_attention_variant.setter
    def decode_attention_variant(self, name: str) -> None:
        self._decode_attention = decode_attention_variant(name)
        self._decode_attention_name = name

    @property
    def fused_projections(self) -> int:
        """How many projection groups (a layer's q/k/v, its gate/up) run as one GEMM."""
        return sum(f is not None for pair in self._fused.values() for f in pair)

    def refresh_fused(self) -> bool:
        """Make every fused projection whose module parameters were rebound (a CPU adoption)
        write through again (fused.py); call before a batch. Whether one had to change."""
        changed = False
        for pair in self._fused.values():
            for fused in pair:
                changed |= fused is not None and fused.refresh()
        return changed

    def _projections(
        self, layer: Layer, which: int, parts: tuple[torch.nn.Linear, ...]
    ) -> tuple[tuple[Linear, ...], tuple[int, ...]]:
        """(linears, sizes) of `parts` for `project`: one fused linear, or one per part."""
        sizes = tuple(int(part.out_features) for part in parts)
        fused = self._fused.get(id(layer), (None, None))[which]
        if fused is not None:
            return (fused.linear,), sizes
        return tuple(_wb(part) for part in parts), sizes

    def _layer_inputs(
        self, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fn: Callable
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv, sizes = self._projections(layer, 0, (layer.q_proj, layer.k_proj, layer.v_proj))
        return fn(
            x, cos, sin, _we(layer.input_norm), qkv, sizes, _we(layer.q_norm), _we(layer.k_norm),
            self.family.head_dim,
        )  # fmt: skip

    def _layer_mlp(
        self, layer: Layer, x: torch.Tensor, attended: torch.Tensor, fn: Callable
    ) -> torch.Tensor:
        gate_up, sizes = self._projections(layer, 1, (layer.gate_proj, layer.up_proj))
        return fn(
            x, attended, _wb(layer.o_proj), _we(layer.post_norm), gate_up, sizes,
            _wb(layer.down_proj),
        )  # fmt: skip

    def _mark_tokens(self, dim: int, *tensors: torch.Tensor) -> None:
        """`_tokens_vary` where the functions are compiled (eager ones need no marks)."""
        if self._compiled:
            _tokens_vary(dim, *tensors)

    def _row_inputs(
        self, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """token_inputs over (tokens, hidden) as one row of tokens (every step of it is per
        token, so the compiled code varies in one size): q (tokens, H, D), k and v
        (tokens, Hkv, D), token-major."""
        tokens = x.shape[0]
        row = [_at_least(t[None], dim=1) for t in (x, cos, sin)]
        self._mark_tokens(1, *row)
        q, k, v = self._layer_inputs(layer, *row, self._token_inputs)
        return q[0, :tokens], k[0, :tokens], v[0, :tokens]

    def _row_mlp(self, layer: Layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """mlp_block over (tokens, hidden) x and (tokens, H * D) attended, MLP_CHUNK_TOKENS at a
        time. Compiled: calls of `mlp_chunks` over MLP_CALL_CHUNKS * MLP_CHUNK_TOKENS tokens or
        fewer (one call a layer for a forward batch of up to 32,768 tokens: 64 rows of 512
        columns); eager: a call per chunk. (tokens, features) matrices: a call's input is then
        a slice of rows, with the strides of a whole matrix (a slice of a (1, tokens, ...) row
        has another outer stride: a recompile)."""
        tokens = x.shape[0]
        per_call = MLP_CALL_CHUNKS if self._compiled else 1  # chunks a call of _token_mlp runs
        calls = -(-tokens // (per_call * MLP_CHUNK_TOKENS))
        if calls == 1:
            x_in, attended_in = (_at_least(t, 0, 2 * per_call) for t in (x, attended))
            self._mark_tokens(0, x_in, attended_in)
            return self._layer_mlp(layer, x_in, attended_in, self._token_mlp)[:tokens]
        out = torch.empty_like(x)
        # Equal parts of more than 2 * per_call tokens each (calls > 1: each is over
        # per_call * MLP_CHUNK_TOKENS / 2).
        for start, end in equal_parts(tokens, calls):
            x_in, attended_in = x[start:end], attended[start:end]
            self._mark_tokens(0, x_in, attended_in)
            out[start:end] = self._layer_mlp(layer, x_in, attended_in, self._token_mlp)
        return out

    def _prefill_masks(
        self, valid: torch.Tensor, dtype: torch.dtype, first_query: int = 0, parts: int = 1
    ) -> PrefillMasks:
        """The additive prefill masks (prefill_mask) of `valid` for every layer window: made
        once per forward, or by blocks of queries in each layer when whole they would pass
        their share of attention.MASK_BYTES (`_attend`; parts: PrefillMasks the forward keeps
        at once)."""
        return PrefillMasks(valid, self._windows(), dtype, first_query, parts)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        masks: PrefillMasks,
        window: int | None,
    ) -> torch.Tensor:
        """prefill_attention of q (b, H, s - first_query, D), the queries of masks.first_query
        on, against k/v (b, Hkv, s, D) under the masks of `window`: one call, or one per block
        of queries against the keys up to its last query (the K/V heads repeated once for all
        of them), written into one output, (b, H, s - first_query, D) heads-first over
        token-major memory (the caller's transpose and reshape to tokens are then views)."""
        scale = self.family.scaling
        if len(masks.blocks) == 1:
            return prefill_attention(q, k, v, masks.block(window, *masks.blocks[0]), scale)
        b, heads, queries, dim = q.shape
        k, v = repeat_kv(heads, k, v)
        out = q.new_empty(b, queries, heads, dim).transpose(1, 2)
        for start, end in masks.blocks:
            rows = slice(start - masks.first_query, end - masks.first_query)
            mask = masks.block(window, start, end)
            out[:, :, rows] = prefill_attention(q[:, :, rows], k[:, :, :end], v[:, :, :end],
                                                mask, scale)  # fmt: skip
        return out

    def _windows(self) -> set[int | None]:
        return {layer.window for layer in self.family.layers}

    def _layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        write: KVWriter | None = None,
    ) -> torch.Tensor:
        """The decoder layers over a row of tokens x (T, hidden), cos/sin (T, D): per-token
        work in one compiled call each (`_row_inputs`, `_row_mlp`), the attention by `attend`;
        write gets each layer's token-major k, v (T, Hkv, D). Final-normed (T, hidden)."""
        f = self.family
        with prefill_backends(self.prefill_backend, x.device):
            for index, layer in enumerate(f.layers):
                q, k, v = self._row_inputs(layer, x, cos, sin)
                if write is not None:
                    write(index, k, v)
                x = self._row_mlp(layer, x, attend(layer, q, k, v))
        return rms_norm(f.norm.weight, f.norm.variance_epsilon, x)

    def _causal_attend(self, rows: CausalRows) -> Attend:
        """Attend by causal_rows.causal_attention over `rows`, whatever the layer."""
        scale = self.family.scaling

        def attend(layer: Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return causal_attention(q, k, v, rows, scale).flatten(1)

        return attend

    def prefill(
        self,
        ids: torch.Tensor,
        valid: torch.Tensor,
        positions: torch.Tensor,
        write: KVWriter | None,
    ) -> torch.Tensor:
        """Final-normed hidden states (b, s, hidden) of left-padded prompts ids (b, s).

        valid (b, s) bool marks real tokens; positions (b, s) are their position ids; write
        receives each layer's K/V (b, Hkv, s, D) (None: nothing keeps them). Long rows attend
        causally over rolled rows (causal_rows.py), others under masks.
        """
        b, s = ids.shape
        x = F.embedding(ids.reshape(-1), self.family.embed.weight)  # (T, hidden)
        cos, sin = self.rope.at(positions.reshape(-1))  # (T, D)
        rows = causal_layout(valid, self._windows())
        if rows is not None:
            attend = self._causal_attend(rows)
        else:
            masks = self._prefill_masks(valid, x.dtype)

            def attend(
                layer: Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
            ) -> torch.Tensor:
                out = self._attend(*(_by_row(t, b) for t in (q, k, v)), masks, layer.window)
                return out.transpose(1, 2).reshape(b * s, -1)

        by_row = None
        if write is not None:

            def by_row(index: int, k: torch.Tensor, v: torch.Tensor) -> None:
                write(index, _by_row(k, b), _by_row(v, b))

        return self._layers(x, cos, sin, attend, by_row).view(b, s, -1)

    def hidden_states(
        self,
        ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        prompt_width: int = 0,
    ) -> torch.Tensor:
        """Final-normed hidden states (b, s, hidden) of padded rows, what HF's base model
        returns as last_hidden_state for the same input_ids, attention_mask (any dtype, 0 for
        pads on either side) and position_ids: the scoring forward (no cache is written).

        prompt_width P > 0: the first P columns are left-padded prompts (scoring's layout);
        rows with the same prompt (a GRPO group) run it once, and their other columns attend
        to its K/V. The same numbers, up to the rounding of smaller matmuls."""
        if position_ids.max() >= self.rope.cos.shape[0]:
            raise ValueError(
                f"position {int(position_ids.max())} is past the model's "
                f"{self.rope.cos.shape[0]} positions"
            )
        self.refresh_fused()
        valid = attention_mask.bool()
        if 0 < prompt_width < ids.shape[1]:
            shared = self._shared_prompts(ids, valid, position_ids, prompt_width)
            if shared is not None:
                return shared
        return self.prefill(ids, valid, position_ids, None)

    def _shared_prompts(
        self, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, width: int
    ) -> torch.Tensor | None:
        """hidden_states with each distinct prompt (the first `width` columns) run once; None
        when every row's prompt is its own (nothing to share).

        The distinct prompts' tokens and every row's other tokens are one row of tokens for
        the per-token work of a layer (norms, projections, RoPE, MLP: one compiled call each,
        as the plain forward makes; a compiled call is host time, and a scoring batch is
        host-bound on an H200); only the attention runs apart: the prompts' against
        themselves, the other columns against their group's prompt and themselves
        (`_shared_attend`), or, for long rows, every row's prompt and rest causally together
        (causal_rows.py), each prompt token's output read from its group's first row."""
        f = self.family
        rows, columns = ids.shape
        prompts = torch.where(valid[:, :width], ids[:, :width], -1)
        distinct, of_row = torch.unique(prompts, dim=0, return_inverse=True)
        groups = distinct.shape[0]
        if groups == rows:
            return None
        first = torch.full((groups,), rows, dtype=torch.long, device=ids.device)
        first.scatter_reduce_(0, of_row, torch.arange(rows, device=ids.device), "amin")
        rest = columns - width
        head_tokens = groups * width  # the prompts' tokens come first in the row

        def row_of(t: torch.Tensor) -> torch.Tensor:  # (rows, columns) -> the row's (tokens,)
            return torch.cat([t[first, :width].reshape(-1), t[:, width:].reshape(-1)])

        x = F.embedding(row_of(ids), f.embed.weight)  # (tokens, hidden)
        cos, sin = self.rope.at(row_of(positions))
        causal = causal_layout(valid, self._windows(), SharedPrompts(width, of_row, first))
        if causal is not None:
            x = self._layers(x, cos, sin, self._causal_attend(causal))
        else:
            x = self._layers(x, cos, sin, self._shared_attend(valid, of_row, first, width))
        head = x[:head_tokens].view(groups, width, -1)
        return torch.cat([head[of_row], x[head_tokens:].view(rows, rest, -1)], dim=1)

    def _shared_attend(
        self, valid: torch.Tensor, of_row: torch.Tensor, first: torch.Tensor, width: int
    ) -> Attend:
        """The attention of _shared_prompts' row of tokens apart: the prompts' tokens against
        themselves, each row's other tokens against its group's prompt and themselves, under
        masks. The prompts alone attend causally where they are long enough (causal_rows.py;
        left-padded, no right pads: nothing suppressed): a long prompt's attention against
        itself outweighs its rows' short rest."""
        rows, columns = valid.shape
        groups, rest = first.numel(), columns - width
        head_tokens = groups * width
        dtype = self.family.embed.weight.dtype
        scale = self.family.scaling
        head_valid = valid[first, :width]
        head_rows = causal_layout(head_valid, self._windows())
        head_masks = (
            None if head_rows is not None else self._prefill_masks(head_valid, dtype, parts=2)
        )
        masks = self._prefill_masks(
            valid, dtype, first_query=width, parts=1 if head_rows is not None else 2
        )
        # The keys of each query row, as indices into the row of tokens: a prompt's own tokens;
        # a row's rest, its group's prompt and then its own. Gathered with each KV head repeated
        # for its query heads (`keys`): one copy a K or V, where the prompt's keys taken for
        # every row, a concatenation and the heads' repeat were three.
        device = valid.device
        head_keys = torch.arange(head_tokens, device=device).view(groups, width, 1)
        own = head_tokens + torch.arange(rows * rest, device=device).view(rows, rest, 1)
        rest_keys = torch.cat([head_keys[of_row], own], dim=1)  # (rows, columns, 1)
        group = self.family.num_heads // self.family.num_kv_heads
        kv_head_of = torch.arange(self.family.num_heads, device=device) // group  # per query head

        def keys(t: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
            """Token-major k or v (tokens, Hkv, D) -> (n, heads, len, D) of `tokens` (n, len,
            1), a heads-first view of one gather."""
            return t[tokens, kv_head_of].transpose(1, 2)

        def parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """Token-major (tokens, heads, D) -> the prompts' (groups, heads, width, D) and
            the rest's (rows, heads, columns - width, D), heads-first views."""
            head = t[:head_tokens].view(groups, width, *t.shape[1:])
            tail = t[head_tokens:].view(rows, rest, *t.shape[1:])
            return head.transpose(1, 2), tail.transpose(1, 2)

        def attend(layer: Layer, *inputs: torch.Tensor) -> torch.Tensor:
            q_head, q = parts(inputs[0])
            _, k_tokens, v_tokens = inputs
            if head_rows is not None:
                heads = causal_attention(*(t[:head_tokens] for t in inputs), head_rows, scale)
                out_head = heads.view(groups, width, *heads.shape[1:]).transpose(1, 2)
            else:
                k_head, v_head = keys(k_tokens, head_keys), keys(v_tokens, head_keys)
                out_head = self._attend(q_head, k_head, v_head, head_masks, layer.window)
            k, v = keys(k_tokens, rest_keys), keys(v_tokens, rest_keys)  # (rows, heads, columns, D)
            out = self._attend(q, k, v, masks, layer.window)
            attended = out.new_empty(inputs[0].shape[0], out.shape[1] * out.shape[3])
            attended_head, attended_rest = parts(attended.view(-1, *out.shape[1::2]))
            attended_head.copy_(out_head)
            attended_rest.copy_(out)
            return attended

        return attend

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        column: torch.Tensor,
        caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        valid: torch.Tensor,
        shared: SharedPrefix | None = None,
    ) -> torch.Tensor:
        """Logits (b, V) of one token per row.

        tokens, positions (b,); column (1,) int64: the cache column this token is written to
        (the same for every row in the left-padded layout); caches: per layer k and v views
        (b, Hkv, w, D); valid (b, w) bool: the columns each row attends to (this one included).
        shared: the rows are groups whose first columns hold the same prompt (shared_prefix.py):
        attention reads those once per group (shared_attention_variant).
        """
        attention = self._decode_attention
        if shared is not None:
            attention = shared_prefix_attention(
                self.shared_attention_variant, shared, self._compiled
            )
        f = self.family
        b = tokens.shape[0]
        x = F.embedding(tokens, f.embed.weight)[:, None]  # (b, 1, hidden)
        cos, sin = self.rope.at(positions[:, None])  # (b, 1, D)
        allowed = {None: valid}
        columns = torch.arange(valid.shape[1], device=valid.device)
        for window in {layer.window for layer in f.layers} - {None}:
            allowed[window] = valid & (columns > column - window)[None]
        masks = {window: additive_mask(mask, x.dtype) for window, mask in allowed.items()}
        for (k_cache, v_cache), layer in zip(caches, f.layers, strict=True):
            q, k, v = self._layer_inputs(layer, x, cos, sin, self._inputs)  # (b, 1, heads, D)
            k_cache.index_copy_(2, column, k.transpose(1, 2))
            v_cache.index_copy_(2, column, v.transpose(1, 2))
            out = attention(q[:, 0], k_cache, v_cache, masks[layer.window], f.scaling)
            x = self._layer_mlp(layer, x, out.reshape(b, 1, -1), self._mlp)
        return self.logits(rms_norm(f.norm.weight, f.norm.variance_epsilon, x[:, 0]))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over final-normed hidden states (..., hidden) -> (..., V)."""
        if self.family.lm_head is None:
            raise TypeError("a decoder body read for scoring has no lm_head (read_body)")
        return F.linear(hidden, *_wb(self.family.lm_head))
