"""The engine's full-sequence forward (prefill, scoring) compiled, on the CPU (Inductor).

On CUDA the engine compiles its layer functions for any token count (model.Forward's
_token_inputs / _token_mlp, dynamic shapes): the warm-up's scoring batch builds them once and
every later forward batch, whatever its rows and columns, reuses that code. Here the same
compiled path runs on the CPU: it gives the eager forward's hidden states over padded rows with
and without shared prompts, and three shapes of rows build no new graph after the first.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollserve.server.experience.scoring import position_ids_from_mask
from rollserve.server.generation import compiling
from rollserve.server.generation import model as generation_model
from rollserve.server.generation.families import read_family
from rollserve.server.generation.model import Forward
from rollserve.server.generation.rotary import RopeTable
from rollserve.server.models.memory import own_memory

VOCAB = 80


def _model(name: str, directory: Path) -> torch.nn.Module:
    import transformers as tf

    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    config = tf.Qwen3Config(**common, head_dim=8) if name == "qwen3" else tf.Qwen2Config(**common)
    torch.manual_seed(0)
    built = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random biases and norm weights, so that reading them matters
        for param_name, tensor in built.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                tensor.add_(torch.randn_like(tensor) * 0.2)
    built.save_pretrained(directory)
    return tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _rows(rows: int, prompt: int, response: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Left-padded prompts (each shared by 2 rows) then right-padded responses."""
    width = prompt + response
    ids = torch.randint(1, VOCAB, (rows, width), generator=g)
    ids[1::2, :prompt] = ids[0::2, :prompt]
    mask = torch.ones(rows, width, dtype=torch.long)
    for row in range(rows):
        mask[row, : (row // 2) % prompt] = 0  # left pads of the prompt (same for a pair)
        mask[row, width - row % response :] = 0  # right pads of the response
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, position_ids_from_mask(mask)


def _count_calls(forward: Forward, name: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets the token count of every call of `forward`'s function `name`."""
    function, calls = getattr(forward, name), []

    def counted(*args: object) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return function(*args)

    monkeypatch.setattr(forward, name, counted)
    return calls


@pytest.mark.parametrize(
    ("name", "one_buffer"), [("qwen2", False), ("qwen3", False), ("qwen2", True)]
)
def test_compiled_sequence_forward_equals_eager_and_compiles_once(
    name: str, one_buffer: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """one_buffer: the weights laid out as a GPU server loads them (models/memory.py): every
    compiled function's weights are views of one storage, and the fused projections views of
    it too; no graph is built again for that."""
    model = _model(name, tmp_path)
    if one_buffer:
        own_memory(model)
    family = read_family(model)
    assert family is not None
    rope = RopeTable(family.rotary, family.max_positions, torch.float32)
    # Compiled as on CUDA: with the projections fused (fused.py), against the plain eager forward.
    eager, compiled = Forward(family, rope), Forward(family, rope, compiled=True, fused=True)
    assert compiled.fused_projections == 2 * len(family.layers)
    if one_buffer:  # fused where they lay: no weight was moved out of the buffer
        storages = {p.untyped_storage().data_ptr() for p in model.state_dict().values()}
        assert len(storages) == 1
    layer_functions = (compiled._token_inputs, compiled._token_mlp)
    torch._dynamo.reset()  # compiled code is cached per function: build it for this model
    counters = torch._dynamo.utils.counters["stats"]
    g = torch.Generator().manual_seed(1)
    graphs_before, graphs_after_first = counters["unique_graphs"], None
    with torch.inference_mode():
        for rows, prompt, response in ((4, 6, 5), (6, 9, 3), (2, 5, 11)):
            ids, mask, positions = _rows(rows, prompt, response, g)
            for shared in (0, prompt):  # the plain forward, then each prompt run once
                want = eager.hidden_states(ids, mask, positions, shared)
                got = compiled.hidden_states(ids, mask, positions, shared)
                if graphs_after_first is None:  # the first call built the code of every size
                    graphs_after_first = counters["unique_graphs"]
                real = mask.bool()
                assert torch.allclose(got[real], want[real], atol=1e-5, rtol=1e-4)
        # A single token (dynamo specialises a size of 1) and MLP chunks with a remainder.
        one = torch.tensor([[7]])
        ones = torch.ones_like(one)
        want, got = (
            f.hidden_states(one, ones, position_ids_from_mask(ones)) for f in (eager, compiled)
        )
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
        # 44 tokens: one call of the MLP function a layer, in MLP_CALL_CHUNKS (8) slices of 5
        # and 6 tokens, then two calls a layer (22 tokens each, in slices of 2 and 3), with the
        # code of the first shape (a compiled call costs the host per call, not per slice).
        ids, mask, positions = _rows(4, 6, 5, g)
        want = eager.hidden_states(ids, mask, positions)
        real = mask.bool()
        mlp_calls = _count_calls(compiled, "_token_mlp", monkeypatch)
        input_calls = _count_calls(compiled, "_token_inputs", monkeypatch)
        # Shared prompts: the prompts' tokens and the rest's in one row, a call each a layer.
        got = compiled.hidden_states(ids, mask, positions, 6)
        assert len(input_calls) == len(mlp_calls) == len(family.layers)
        assert torch.allclose(got[real], want[real], atol=1e-5, rtol=1e-4)
        for chunk_tokens, calls in ((16, 1), (4, 2)):
            monkeypatch.setattr(generation_model, "MLP_CHUNK_TOKENS", chunk_tokens)
            mlp_calls.clear()
            got = compiled.hidden_states(ids, mask, positions)
            assert len(mlp_calls) == calls * len(family.layers)
            assert torch.allclose(got[real], want[real], atol=1e-5, rtol=1e-4)
    assert all(fn.compiled is not None for fn in layer_functions)  # no fallback to eager
    assert graphs_after_first >= graphs_before + 2  # both functions compiled
    assert counters["unique_graphs"] == graphs_after_first  # the later shapes built nothing


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_the_compiled_layer_functions_take_the_token_count_as_their_one_runtime_size(
    name: str, tmp_path: Path
) -> None:
    """Compiled with every size symbolic (torch.compile's dynamic=True, before), each
    elementwise kernel split its flat index by runtime head and feature sizes: integer
    divisions per element (the H200's RoPE kernel ran at ~5x its bytes). With the token
    dimension marked dynamic (model._tokens_vary) and the rest constant, Inductor's kernels
    take one runtime size, the token count, whatever the layout of the rows."""
    from torch._inductor.utils import run_and_get_code

    model = _model(name, tmp_path)
    family = read_family(model)
    assert family is not None
    rope = RopeTable(family.rotary, family.max_positions, torch.float32)
    forward = Forward(family, rope, compiled=True, fused=True)
    torch._dynamo.reset()  # compiled code is cached per function: build it here
    ids, mask, positions = _rows(4, 6, 5, torch.Generator().manual_seed(1))
    with torch.inference_mode():
        _, codes = run_and_get_code(lambda: forward.hidden_states(ids, mask, positions, 6))
    assert len(codes) == 2  # token_inputs and mlp_chunks, one graph each
    for code in codes:
        assert set(re.findall(r"\bks\d+\b", code)) == {"ks0"}, code


def test_a_compiled_mlp_call_projects_and_norms_every_token_at_once(tmp_path: Path) -> None:
    """model.mlp_chunks: the output projection and the norm over all tokens (one GEMM and one
    kernel a call), only the SwiGLU's two GEMMs a chunk: each kernel of a compiled call is a
    launch of host time (the o-projection and the norm a chunk were 36 kernels a call on
    this CPU's Inductor, now 26)."""
    from torch._inductor.utils import run_and_get_code

    model = _model("qwen2", tmp_path)
    family = read_family(model)
    assert family is not None
    rope = RopeTable(family.rotary, family.max_positions, torch.float32)
    forward = Forward(family, rope, compiled=True, fused=True)
    torch._dynamo.reset()
    ids, mask, positions = _rows(4, 6, 5, torch.Generator().manual_seed(2))
    with torch.inference_mode():
        _, codes = run_and_get_code(lambda: forward.hidden_states(ids, mask, positions))
    (mlp,) = [code for code in codes if "silu" in code]
    gemms = re.findall(r"extern_kernels\.(?:addmm|mm)\(", mlp)
    assert len(gemms) == 1 + 2 * generation_model.MLP_CALL_CHUNKS, mlp


def test_the_cpp_wrapper_switch_compiles_the_layer_functions_with_inductors_cpp_wrapper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ROLLSERVE_ENGINE_CPP_WRAPPER=1 (compiling.full_sequence_options): the full-sequence
    functions are the C++ wrapper's (code objects of their own); one of them built here
    (a C++ compile is ~15 s on this CPU, each): its code has an `inductor_entry` and no Python
    `call`, its q/k/v those of eager. The default's functions are the plain ones."""
    from torch._inductor.utils import run_and_get_code

    model = _model("qwen2", tmp_path)
    family = read_family(model)
    assert family is not None
    rope = RopeTable(family.rotary, family.max_positions, torch.float32)
    default = Forward(family, rope, compiled=True, fused=True)
    assert default._token_inputs.eager is generation_model.token_inputs
    assert default._token_mlp.eager is generation_model.mlp_chunks
    monkeypatch.setenv(compiling.CPP_WRAPPER_ENV, "1")
    cpp = Forward(family, rope, compiled=True, fused=True)
    assert cpp._token_inputs.eager is generation_model.cpp_token_inputs
    assert cpp._token_mlp.eager is generation_model.cpp_mlp_chunks
    assert Forward(family, rope)._token_mlp is generation_model.mlp_block  # eager: no switch
    torch._dynamo.reset()  # compiled code is cached per function: build it here
    g = torch.Generator().manual_seed(3)
    x, cos, sin = torch.randn(37, 32, generator=g), *rope.at(torch.arange(37))
    layer = family.layers[0]
    with torch.inference_mode():
        got, codes = run_and_get_code(lambda: cpp._row_inputs(layer, x, cos, sin))
        eager = Forward(family, rope, fused=True)._row_inputs(layer, x, cos, sin)
    assert len(codes) == 1 and "inductor_entry" in codes[0] and "def call(" not in codes[0]
    assert cpp._token_inputs.compiled is not None  # no fallback to eager
    for a, b in zip(got, eager, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    monkeypatch.setenv(compiling.CPP_WRAPPER_ENV, "yes")
    with pytest.raises(ValueError, match=compiling.CPP_WRAPPER_ENV):
        Forward(family, rope, compiled=True)


@pytest.fixture(scope="module")
def qwen2_forwards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Forward, Forward]:
    """A qwen2's eager forward and its compiled one over fused projections (CUDA's default)."""
    model = _model("qwen2", tmp_path_factory.mktemp("qwen2-layouts"))
    family = read_family(model)
    assert family is not None
    rope = RopeTable(family.rotary, family.max_positions, torch.float32)
    return Forward(family, rope), Forward(family, rope, compiled=True, fused=True)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    groups=st.lists(
        st.tuples(st.integers(1, 6), st.lists(st.integers(0, 6), min_size=1, max_size=4)),
        min_size=1,
        max_size=4,
    ),
    share=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_compiled_forward_equals_eager_for_any_layout(
    qwen2_forwards: tuple[Forward, Forward],
    groups: list[tuple[int, list[int]]],
    share: bool,
    seed: int,
) -> None:
    """Groups of 1 to 4 rows sharing a prompt of 1 to 6 tokens (left-padded to the widest),
    responses of 0 to 6 tokens (right-padded), pad ids random: the compiled forward with the
    prompts shared (or not) gives the eager plain forward's hidden states on every real token."""
    eager, compiled = qwen2_forwards
    g = torch.Generator().manual_seed(seed)
    width = max(prompt for prompt, _ in groups)
    columns = width + max(1, max(max(lengths) for _, lengths in groups))
    rows = [(prompt, length) for prompt, lengths in groups for length in lengths]
    ids = torch.randint(0, VOCAB, (len(rows), columns), generator=g)
    mask = torch.zeros_like(ids)
    start = 0
    for prompt, lengths in groups:  # one prompt per group: its rows' prompt columns equal
        ids[start : start + len(lengths), width - prompt : width] = torch.randint(
            1, VOCAB, (prompt,), generator=g
        )
        start += len(lengths)
    for row, (prompt, length) in enumerate(rows):
        mask[row, width - prompt : width + length] = 1
    positions = position_ids_from_mask(mask)
    with torch.inference_mode():
        want = eager.hidden_states(ids, mask, positions)
        got = compiled.hidden_states(ids, mask, positions, width if share else 0)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-4)


def test_compiled_decode_steps_generate_what_eager_ones_do(tmp_path: Path) -> None:
    """The decode step's compiled layer functions over fused projections (the CUDA default,
    here Inductor on the CPU): token-major outputs written to the cache as heads-first views;
    greedy tokens equal the eager engine's, log-probs to rounding."""
    from rollserve.server.experience.generation import SamplingParams
    from rollserve.server.generation.runner import Engine

    model = _model("qwen2", tmp_path)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (3, 6), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :2] = False  # a left-padded row
    ids = ids.masked_fill(~mask, 0)
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    results = []
    for compiled in (False, True):
        engine = Engine(model, read_family(model), kv_cache_tokens=1 << 12, compiled=compiled,
                        fused=compiled)  # fmt: skip
        results.append(engine.generate(ids, mask, params, pad_token_id=0,
                                       generator=torch.Generator()))  # fmt: skip
    assert engine.forward._inputs.compiled is not None  # compiled, no fallback to eager
    assert engine.forward._mlp.compiled is not None
    eager, compiled = results
    assert compiled.response_mask.all()
    assert torch.equal(compiled.response, eager.response)
    torch.testing.assert_close(compiled.log_probs, eager.log_probs, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
def test_on_cuda_a_compiled_mlp_call_holds_one_chunks_products_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One compiled MLP call runs MLP_CALL_CHUNKS token chunks (model.mlp_chunks): the bound on
    a forward's MLP temporaries holds only if the compiler keeps each chunk's wide products
    (gate/up, SwiGLU: 3 x intermediate a token) apart, freed before the next chunk's. The
    allocator's peak of a compiled forward with its MLP in 8 chunks against in one."""
    import transformers as tf

    config = tf.Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=4096, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    family = read_family(model)
    assert family is not None
    rope = RopeTable(family.rotary, family.max_positions, torch.bfloat16)
    forward = Forward(family, rope, compiled=True, fused=True)
    rows, columns = 8, 512  # 4096 tokens, one MLP call
    ids = torch.randint(1, VOCAB, (rows, columns), device="cuda")
    mask = torch.ones_like(ids)
    positions = position_ids_from_mask(mask)
    monkeypatch.setattr(generation_model, "MLP_CHUNK_TOKENS", 1 << 20)
    peaks = {}
    with torch.inference_mode():
        for chunks in (1, 8):
            monkeypatch.setattr(generation_model, "MLP_CALL_CHUNKS", chunks)
            forward.hidden_states(ids, mask, positions)  # compiles for this chunk count
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            forward.hidden_states(ids, mask, positions)
            torch.cuda.synchronize()
            peaks[chunks] = torch.cuda.max_memory_allocated() - start
    assert forward._token_mlp.compiled is not None  # compiled, not the eager fallback
    wide = rows * columns * 3 * config.intermediate_size * 2  # bytes of the products at once
    # In 8 chunks an eighth of them is live at a time: at least half of them saved.
    assert peaks[8] < peaks[1] - wide / 2, (peaks, wide)
