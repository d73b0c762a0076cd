"""rollserve's generation engine on CUDA in bfloat16: HF parity, CUDA graphs vs eager, weights.

bfloat16 kernels differ between the engine and HF, so greedy parity is an agreement rate, not
equality; graphs replay the very kernels the eager step runs, so they must agree exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rollserve.server.experience.generation import SamplingParams, generate, left_pad
from rollserve.server.experience.scoring import action_log_probs
from rollserve.server.generation import Engine, engine_for, engine_path, read_family

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

PAD = 0
VOCAB = 2048


def prompts(rows: int, samples: int = 1, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    distinct = [
        torch.randint(1, VOCAB, (int(n),), generator=g).tolist()
        for n in torch.randint(8, 40, (rows // samples,), generator=g)
    ]
    return [p for p in distinct for _ in range(samples)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
        pad_token_id=PAD, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("qwen2")
    Qwen2ForCausalLM(config).save_pretrained(path)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    loaded.generation_config.eos_token_id = None
    return loaded.to("cuda").eval()


def run(model, rows, params, seed=0, **kw):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return generate(model, rows, params, pad_token_id=PAD, generator=g, **kw)


def test_auto_path_is_the_engine_on_cuda(model) -> None:
    assert engine_path(model) == "rollserve"
    assert engine_for(model).use_graphs


def test_greedy_agrees_with_hf_generate(model) -> None:
    rows = prompts(32)
    ids, mask = left_pad(rows, PAD, torch.device("cuda"))
    with torch.inference_mode():
        theirs = model.generate(
            input_ids=ids, attention_mask=mask.long(), do_sample=False, pad_token_id=PAD,
            max_new_tokens=32, eos_token_id=None,
        )[:, ids.shape[1] :]  # fmt: skip
    ours = run(model, rows, SamplingParams(max_new_tokens=32, temperature=0.0))
    mine = ours.sequences[:, ours.prompt_width :]
    assert (mine[:, 0] == theirs[:, 0]).float().mean() >= 0.9
    # Rows agree up to the first near-tie; most rows agree for many tokens.
    agree = (mine == theirs).long().cumprod(-1).sum(-1).float()
    assert agree.mean() >= 16, agree


def test_graphs_replay_equal_eager(model) -> None:
    rows = prompts(40, samples=4)  # 40 rows: bucket 48, compactions to smaller buckets
    params = SamplingParams(
        max_new_tokens=64, temperature=0.9, top_k=50, top_p=0.95,
        stop_sequences=tuple((t,) for t in range(3, VOCAB, 97)),
    )  # fmt: skip
    ids, mask = left_pad(rows, PAD, torch.device("cuda"))
    family = read_family(model)
    plain, engine = Engine(model, family, cuda_graphs=False), Engine(model, family)
    results = []
    for runner in (plain, engine, engine):  # the second graph run replays captured graphs
        g = torch.Generator(device="cuda").manual_seed(3)
        results.append(runner.generate(ids, mask, params, pad_token_id=PAD, generator=g))
    eager, captured, replayed = results
    assert engine.use_graphs and engine._workspaces  # graphs were captured
    for other in (captured, replayed):
        assert torch.equal(eager.response, other.response)
        assert torch.equal(eager.stopped, other.stopped)
        torch.testing.assert_close(eager.log_probs, other.log_probs, atol=1e-5, rtol=0)
    assert eager.stopped.any() and not eager.stopped.all()


def test_recorded_log_probs_match_rescoring(model) -> None:
    rows = prompts(16, samples=4)
    out = run(model, rows, SamplingParams(max_new_tokens=48, temperature=1.0))
    rescored, _ = action_log_probs(
        model, out.sequences, out.attention_mask, out.action_mask.shape[1], forward_batch_size=16
    )
    gap = (rescored - out.action_log_probs)[out.action_mask].abs()
    assert gap.mean() < 0.05, gap.mean()  # bfloat16 kernels differ, not the numbers' meaning


def test_weight_updates_reach_the_graphs(model, tmp_path: Path) -> None:
    """A copy into the parameters (UpdateWeights on CUDA) is read by the captured graphs; a
    swapped storage is noticed and the graphs are dropped."""
    rows = prompts(8)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    engine = Engine(model, read_family(model))
    eager = Engine(model, read_family(model), cuda_graphs=False)
    ids, mask = left_pad(rows, PAD, torch.device("cuda"))

    def both():
        g = torch.Generator(device="cuda")
        kw = dict(pad_token_id=PAD, generator=g)
        return engine.generate(ids, mask, params, **kw), eager.generate(ids, mask, params, **kw)

    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        before, _ = both()
        before, _ = both()  # replayed
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.05)
        graphs, plain = both()
        assert not torch.equal(graphs.response, before.response)
        assert torch.equal(graphs.response, plain.response)
        with torch.no_grad():
            for p in model.parameters():
                p.data = torch.randn_like(p) * 0.05
        graphs, plain = both()
        assert torch.equal(graphs.response, plain.response)
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.data = saved[name]


@pytest.mark.parametrize(
    "filters", [{}, {"top_p": 0.9}, {"top_k": 50, "top_p": 0.95}], ids=["plain", "top_p", "top_k_p"]
)
def test_a_large_vocabulary_at_a_small_batch(tmp_path: Path, filters: dict) -> None:
    """A Qwen-sized vocabulary (151936) at batch 32: the compiled sampler's shapes that once
    broke Inductor (a split float64 scan); recorded log-probs still match re-scoring."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    out = run(model, prompts(32, samples=8), SamplingParams(max_new_tokens=24, **filters))
    rescored, _ = action_log_probs(
        model, out.sequences, out.attention_mask, out.action_mask.shape[1], forward_batch_size=32
    )
    gap = (rescored - out.action_log_probs)[out.action_mask].abs()
    assert gap.mean() < 0.05, gap.mean()
    engine = engine_for(model)
    assert engine.forward._inputs.compiled is not None, "the layer functions fell back to eager"
    sampler = next(iter(engine._workspaces.values())).sampler
    assert sampler._prepared.compiled is not None, "the sampler fell back to eager"
