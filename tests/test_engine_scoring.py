"""Scoring through the engine's forward (server/generation) against the HF forward, on the CPU.

Tiny Llama, Qwen2, Qwen3 and Mistral configs in float32, saved and loaded: the actor's log-probs
and entropy (lm_head in chunks), a critic's values (*ForTokenClassification) and a reward
model's scores (*ForSequenceClassification) over ragged rows (left-padded prompts, right-padded
responses), on path "rollserve" (the engine's forward) and path "hf" (the HF module's).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from rollserve.server.experience.scoring import action_log_probs, critic_values, reward_scores
from rollserve.server.experience.vocab_chunks import VOCAB_CHUNKS_ENV
from rollserve.server.generation import (
    GenerationSettings,
    adopt_settings,
    scoring_forward,
    scoring_path,
)
from rollserve.server.generation import model as generation_model

PAD = 0
VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD,
    bos_token_id=None, eos_token_id=None, num_labels=1,
)  # fmt: skip
FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33], [40], [50, 51, 52, 53, 54, 55]]
RESPONSE_LENGTHS = [5, 9, 1, 3, 7]  # ragged: every row ends in its own number of pads


def _config(name: str):
    import transformers as tf

    if name == "llama":
        return tf.LlamaConfig(**COMMON)
    if name == "qwen2":
        return tf.Qwen2Config(**COMMON)
    if name == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True)
    if name == "mistral":  # a window shorter than the rows, so it matters
        return tf.MistralConfig(**COMMON, sliding_window=6)
    raise KeyError(name)


def _built(kind: str, name: str, directory: Path) -> torch.nn.Module:
    """A random model of `kind` saved to and loaded from `directory`, in eval mode."""
    import transformers as tf

    auto = {
        "causal_lm": tf.AutoModelForCausalLM,
        "critic": tf.AutoModelForTokenClassification,
        "reward": tf.AutoModelForSequenceClassification,
    }[kind]
    torch.manual_seed(FAMILIES.index(name))
    built = auto.from_config(_config(name))
    with torch.no_grad():  # random biases and norm weights, so that reading them matters
        for param_name, tensor in built.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                tensor.add_(torch.randn_like(tensor) * 0.2)
    built.save_pretrained(directory)
    return auto.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def models(family: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.nn.Module]:
    root = tmp_path_factory.mktemp(family)
    return {kind: _built(kind, family, root / kind) for kind in ("causal_lm", "critic", "reward")}


def rows(samples: int = 1) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sequences (B, P + A) of left-padded prompts and right-padded responses, their mask, A;
    each prompt `samples` times in a row (a GRPO group: the engine runs its prompt once), the
    pad ids under a group's prompt differing (they must not matter)."""
    g = torch.Generator().manual_seed(0)
    width, actions = max(map(len, PROMPTS)), max(RESPONSE_LENGTHS)
    prompts = [p for p in PROMPTS for _ in range(samples)]
    lengths = [(n + i) % actions + 1 for n in RESPONSE_LENGTHS for i in range(samples)]
    sequences = torch.randint(0, VOCAB, (len(prompts), width + actions), generator=g)
    mask = torch.zeros_like(sequences)
    for row, (prompt, length) in enumerate(zip(prompts, lengths, strict=True)):
        response = torch.randint(1, VOCAB, (length,), generator=g)
        sequences[row, width - len(prompt) : width] = torch.tensor(prompt)
        sequences[row, width : width + length] = response
        mask[row, width - len(prompt) : width + length] = 1
    return sequences, mask, actions


def compared(model: torch.nn.Module, mask: torch.Tensor, actions: int) -> torch.Tensor:
    """The action columns compared with HF: every one, the right-padded ones included (a pad
    query sees the real keys before it, as in HF), except, under a sliding window, pad queries
    with no real key inside their window: HF gives them a zero attention output, the engine
    their own value (finite either way; masked columns, never read)."""
    if getattr(model.config, "sliding_window", None) is None:
        return torch.ones((mask.shape[0], actions), dtype=torch.bool)
    return mask[:, -actions - 1 : -1].bool()


def assert_scores_close(ours, theirs, model: torch.nn.Module, mask: torch.Tensor, actions: int):
    """Each pair of (B, A) results (log-probs, entropy) equal at the `compared` columns."""
    where = compared(model, mask, actions)
    for mine, other in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine[where], other[where], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("samples", [1, 3])
def test_actor_log_probs_and_entropy_equal_hf(models, samples: int) -> None:
    model = models["causal_lm"]
    sequences, mask, actions = rows(samples)
    assert scoring_path(model, "rollserve") == "rollserve"
    kw = dict(forward_batch_size=2, with_entropy=True, positions_per_chunk=7)
    for temperature in (None, 0.7):
        ours = action_log_probs(model, sequences, mask, actions, temperature=temperature,
                                path="rollserve", **kw)  # fmt: skip
        theirs = action_log_probs(model, sequences, mask, actions, temperature=temperature,
                                  path="hf", **kw)  # fmt: skip
        assert_scores_close(ours, theirs, model, mask, actions)


@pytest.mark.parametrize("samples", [1, 3])
def test_the_mlp_in_token_chunks_gives_the_same_numbers(
    models, samples: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunks of 5 tokens cut rows (and a group's shared prompt) mid-way: the per-token MLP must
    # not notice (the default, 4096, bounds a forward's largest temporaries).
    model = models["causal_lm"]
    sequences, mask, actions = rows(samples)
    kw = dict(forward_batch_size=4, with_entropy=True, temperature=0.7, path="rollserve")
    whole = action_log_probs(model, sequences, mask, actions, **kw)
    monkeypatch.setattr(generation_model, "MLP_CHUNK_TOKENS", 5)
    chunked = action_log_probs(model, sequences, mask, actions, **kw)
    assert_scores_close(chunked, whole, model, mask, actions)


@pytest.mark.parametrize("samples", [1, 3])
def test_the_attention_in_blocks_of_queries_gives_the_same_numbers(
    models, samples: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A mask bound of a few queries a block (attention.MASK_BYTES: whole masks of long rows
    # are quadratic): every layer attends block by block, each block against the keys up to its
    # last query, for the rows' own prompts and for a group's prompt run once and the rest.
    from rollserve.server.generation import attention, causal_rows

    monkeypatch.setenv(causal_rows.CAUSAL_MIN_COLUMNS_ENV, str(1 << 30))  # the masked route
    model = models["causal_lm"]
    sequences, mask, actions = rows(samples)
    kw = dict(forward_batch_size=4, with_entropy=True, temperature=0.7)
    hf = action_log_probs(model, sequences, mask, actions, path="hf", **kw)
    budget = 4 * sequences.shape[1] * (4 + attention.MASK_BUILD_BYTES) * 2  # 2 queries a block
    monkeypatch.setattr(attention, "MASK_BYTES", budget)
    masks: list[torch.Tensor] = []

    def spy(q, k, v, mask, scale):
        masks.append(mask)
        return attention.prefill_attention(q, k, v, mask, scale)

    monkeypatch.setattr(generation_model, "prefill_attention", spy)
    blocked = action_log_probs(model, sequences, mask, actions, path="rollserve", **kw)
    assert_scores_close(blocked, hf, model, mask, actions)
    forwards = -(-sequences.shape[0] // 4)
    layers = model.config.num_hidden_layers
    assert len(masks) > 2 * forwards * layers  # several blocks a layer
    for made in masks:  # (b, 1, queries, keys): within the bound, or one query
        b, _, queries, keys = made.shape
        assert queries == 1 or b * queries * keys * (4 + attention.MASK_BUILD_BYTES) <= budget


@pytest.mark.parametrize("samples", [1, 3])
def test_long_rows_attend_causally_and_score_as_hf(
    models, samples: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rows past causal_rows.CAUSAL_MIN_COLUMNS (here every row) attend causally over rolled
    # rows, with no mask: the actor's log-probs and the critic's values equal HF's at every
    # compared column, the right pads' included (their pad keys suppressed). Mistral's window
    # is shorter than the rows: they keep the masked attention.
    from rollserve.server.generation import causal_rows

    monkeypatch.setenv(causal_rows.CAUSAL_MIN_COLUMNS_ENV, "0")
    calls: list[int] = []

    def counted(q, k, v, rows, scale):
        calls.append(int(rows.pads is not None))
        return causal_rows.causal_attention(q, k, v, rows, scale)

    monkeypatch.setattr(generation_model, "causal_attention", counted)
    sequences, mask, actions = rows(samples)
    kw = dict(forward_batch_size=4, with_entropy=True, temperature=0.7)
    model, critic = models["causal_lm"], models["critic"]
    ours = action_log_probs(model, sequences, mask, actions, path="rollserve", **kw)
    theirs = action_log_probs(model, sequences, mask, actions, path="hf", **kw)
    assert_scores_close(ours, theirs, model, mask, actions)
    values = critic_values(critic, sequences, mask, actions, forward_batch_size=4, path="rollserve")
    expected = critic_values(critic, sequences, mask, actions, forward_batch_size=4, path="hf")
    where = compared(critic, mask, actions)
    torch.testing.assert_close(values[where], expected[where], atol=1e-5, rtol=1e-5)
    forwards = 2 * -(-sequences.shape[0] // 4)
    if getattr(model.config, "sliding_window", None) is not None:
        # Whole rows pass the window: masked; only a group's prompts that fit it attend
        # causally among themselves (left pads only: nothing suppressed).
        assert not any(calls)
    else:
        assert len(calls) == forwards * model.config.num_hidden_layers
        assert all(calls)  # every batch has right pads: suppressed


def test_long_shared_prompts_attend_causally_alone_and_score_as_hf(
    models, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A group's prompt run once whose rows' rest is short against it: the whole rows would be
    # more causal work than the masked pair (causal_work_fits, forced false here), so the rest
    # attends under its mask while the prompts, long enough, attend causally among themselves
    # (left pads only: nothing suppressed). HF's log-probs either way.
    from rollserve.server.generation import causal_rows

    monkeypatch.setenv(causal_rows.CAUSAL_MIN_COLUMNS_ENV, "0")
    monkeypatch.setattr(causal_rows, "causal_work_fits", lambda *args: False)
    calls: list[bool] = []

    def counted(q, k, v, rows, scale):
        calls.append(rows.pads is None)
        return causal_rows.causal_attention(q, k, v, rows, scale)

    monkeypatch.setattr(generation_model, "causal_attention", counted)
    model = models["causal_lm"]
    sequences, mask, actions = rows(3)
    kw = dict(forward_batch_size=6, with_entropy=True)
    ours = action_log_probs(model, sequences, mask, actions, path="rollserve", **kw)
    theirs = action_log_probs(model, sequences, mask, actions, path="hf", **kw)
    assert_scores_close(ours, theirs, model, mask, actions)
    assert all(calls)  # the prompts' rows: left pads only, nothing suppressed
    if getattr(model.config, "sliding_window", None) is None:
        forwards = -(-sequences.shape[0] // 6)
        assert len(calls) == forwards * model.config.num_hidden_layers
    # (Mistral's window of 6: causal only for a forward batch whose trimmed prompts fit it.)


@pytest.mark.parametrize("samples", [1, 3])
def test_critic_values_equal_hf(models, samples: int) -> None:
    critic = models["critic"]
    sequences, mask, actions = rows(samples)
    assert scoring_path(critic, "rollserve") == "rollserve"
    ours = critic_values(critic, sequences, mask, actions, forward_batch_size=4, path="rollserve")
    theirs = critic_values(critic, sequences, mask, actions, forward_batch_size=4, path="hf")
    assert ours.shape == (len(PROMPTS) * samples, actions)
    where = compared(critic, mask, actions)
    torch.testing.assert_close(ours[where], theirs[where], atol=1e-5, rtol=1e-5)


def test_reward_scores_equal_hf(models) -> None:
    reward = models["reward"]
    sequences, mask, _ = rows()
    ours = reward_scores(reward, sequences, mask, forward_batch_size=2, path="rollserve")
    theirs = reward_scores(reward, sequences, mask, forward_batch_size=2, path="hf")
    assert ours.shape == (len(PROMPTS),)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_engine_scoring_never_runs_the_hf_body_nor_full_logits(
    models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the engine path the HF backbone is never called, and lm_head sees at most
    positions_per_chunk (row, column) pairs at once: no (rows, columns, V) logits (the
    position blocks, the CPU's default; tests/test_vocab_chunks.py has the vocabulary chunks)."""
    monkeypatch.setenv(VOCAB_CHUNKS_ENV, "0")
    model = models["causal_lm"]
    sequences, mask, actions = rows()
    backbone_calls, head_rows = [], []
    hooks = [
        model.model.register_forward_pre_hook(lambda *_: backbone_calls.append(1)),
        model.lm_head.register_forward_pre_hook(
            lambda _, args: head_rows.append(args[0].shape[:-1].numel())
        ),
    ]
    try:
        action_log_probs(model, sequences, mask, actions, forward_batch_size=5,
                         positions_per_chunk=6, path="rollserve")  # fmt: skip
        assert not backbone_calls and not head_rows  # the engine reads lm_head's weight itself
        forward = scoring_forward(model, "rollserve")
        blocks = []
        original = forward.logits
        forward.logits = lambda hidden: blocks.append(hidden.shape[:-1].numel()) or original(hidden)
        try:
            action_log_probs(model, sequences, mask, actions, forward_batch_size=5,
                             positions_per_chunk=6, path="rollserve")  # fmt: skip
        finally:
            del forward.logits
        assert blocks and max(blocks) <= 6 and sum(blocks) == len(PROMPTS) * actions
        action_log_probs(model, sequences, mask, actions, forward_batch_size=5, path="hf")
        assert backbone_calls  # the HF path does run it
    finally:
        for hook in hooks:
            hook.remove()


def test_the_path_follows_generation_and_the_adopted_settings(tmp_path: Path) -> None:
    model = _built("causal_lm", "llama", tmp_path / "lm")
    critic = _built("critic", "llama", tmp_path / "critic")
    for each in (model, critic):
        assert scoring_path(each) == "hf"  # auto on the CPU: HF, as generation
        assert scoring_path(each, "hf") == "hf"
        assert scoring_forward(each) is None
    adopt_settings(critic, GenerationSettings(path="rollserve"))  # what a server's maker does
    assert scoring_path(critic) == "rollserve"
    assert scoring_forward(critic) is scoring_forward(critic)  # one per model
    calls = []
    hook = critic.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        sequences, mask, actions = rows()
        critic_values(critic, sequences, mask, actions, forward_batch_size=8)
    finally:
        hook.remove()
    assert not calls  # the adopted path ran the body on the engine


def test_an_unsupported_body_scores_on_hf(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, pad_token_id=PAD)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    gpt2 = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert scoring_path(gpt2, "rollserve") == "hf" and scoring_forward(gpt2, "rollserve") is None
    sequences, mask, actions = rows()
    ours, _ = action_log_probs(gpt2, sequences, mask, actions, forward_batch_size=4,
                               path="rollserve")  # fmt: skip
    theirs, _ = action_log_probs(gpt2, sequences, mask, actions, forward_batch_size=4, path="hf")
    assert torch.equal(ours, theirs)


def test_a_maker_on_the_engine_path_warms_up_and_scores_there(
    tiny_actor_dir: Path,
    tiny_critic_dir: Path,
    tiny_reward_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server's maker with --generation-path rollserve: warm_up builds the actor's engine
    (every bucket up to generate_batch_size); a request's actor, reference and critic scores
    and reward model scores come from the engine's forward (the HF bodies never run) and
    equal HF scoring of the returned rows; the recorded log-probs equal the re-scored ones."""
    from rollserve.server.config import ServerConfig
    from rollserve.server.experience.maker import NaiveExperienceMaker
    from rollserve.server.experience.request import RequestDefaults
    from rollserve.server.experience.rewards import RewardRegistry
    from rollserve.server.generation import built_engine
    from rollserve.server.models import load_models

    config = ServerConfig(
        actor=str(tiny_actor_dir), critic=str(tiny_critic_dir),
        reward_model=str(tiny_reward_dir), device="cpu",
    )  # fmt: skip
    models = load_models(config)
    defaults = RequestDefaults(
        default_preset="openrlhf", max_new_tokens=10, generate_batch_size=8,
        forward_batch_size=4, micro_batch_size=8, max_request_rows=64,
    )  # fmt: skip
    maker = NaiveExperienceMaker(
        models, RewardRegistry.from_specs([]), defaults,
        generation=GenerationSettings(path="rollserve"),
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="rollserve.experience"):
        assert maker.warm_up() > 0
    # The memory figures once at start (on the CPU: the engine's own sizes, device figures 0).
    assert "engine memory after the warm-up (GiB; graphs: a count): weights 0.00" in caplog.text
    assert ", kv_cache " in caplog.text and ", peak_allocated 0.00" in caplog.text
    (warmed,) = built_engine(models.actor.module)._workspaces.values()
    assert {key[0] for key in warmed.shapes} == {8, 4, 2, 1}  # (bucket, width, ...)
    calls: list[str] = []
    hooks = [
        loaded.module.model.register_forward_pre_hook(lambda *_, r=loaded.role: calls.append(r))
        for loaded in models.loaded()
    ]
    try:
        e = maker.make_experience(
            [[5, 6, 7], [8, 9, 10, 11, 12]], samples_per_prompt=2, seed=3, temperature=1.0,
            rewards=["reward_model"], algorithm={"advantage_estimator": "gae"},
        )  # fmt: skip
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == []  # no HF body ran: generation and every score on the engine
    mask, actions = e.action_mask, e.num_actions
    seqs, attention = e.sequences, e.attention_mask
    for module, mine in ((models.actor.module, e.action_log_probs),
                         (models.reference.module, e.base_action_log_probs)):  # fmt: skip
        hf, _ = action_log_probs(module, seqs, attention, actions, forward_batch_size=4, path="hf")
        torch.testing.assert_close(mine[mask], hf[mask], atol=2e-5, rtol=1e-5)
    values = critic_values(
        models.critic.module, seqs, attention, actions, forward_batch_size=4, path="hf"
    )
    torch.testing.assert_close(e.values[mask], values[mask], atol=2e-5, rtol=1e-5)
    scores = reward_scores(models.reward.module, seqs, attention, forward_batch_size=4, path="hf")
    torch.testing.assert_close(e.info["reward/reward_model"], scores, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(
        e.rollout_log_probs[mask], e.action_log_probs[mask], atol=2e-5, rtol=0
    )


def test_lm_head_blocks_are_as_large_as_the_chunk_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Qwen2-sized vocabulary: lm_head runs on blocks of every row x the action columns a
    SCORING_CHUNK_BYTES float32 block holds, exactly as many as lm_head_plan says (a regression
    to small blocks, each a GPU round of launches and a read of lm_head's weight, fails), and
    the log-probs still equal the HF path's. (The position blocks: the CPU's default.)"""
    monkeypatch.setenv(VOCAB_CHUNKS_ENV, "0")
    import transformers as tf
    from rollserve.server.experience.scoring import (
        _logits_head,
        default_positions_per_chunk,
        lm_head_plan,
    )
    from rollserve.server.generation import SCORING_CHUNK_BYTES

    vocab, groups, samples, width, actions = 151_936, 8, 8, 4, 16
    config = tf.Qwen2Config(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    tf.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    model = tf.Qwen2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model.requires_grad_(False)  # as a server loads it (models/loading.py)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, vocab, (groups, width), generator=g).repeat_interleave(samples, 0)
    responses = torch.randint(1, vocab, (groups * samples, actions), generator=g)
    sequences = torch.cat([prompts, responses], 1)
    mask = torch.ones_like(sequences)
    rows_ = groups * samples

    plan = lm_head_plan(rows_, actions, default_positions_per_chunk(model))
    block_bytes = plan.rows * plan.columns * vocab * 4
    assert plan.rows == rows_ and SCORING_CHUNK_BYTES // 2 < block_bytes <= SCORING_CHUNK_BYTES
    # The forward batch (64 rows x 256 actions): 86 blocks of 3 columns at 128 MiB.
    assert lm_head_plan(64, 256, default_positions_per_chunk(model)).blocks <= 43

    # Each block reaches lm_head as one contiguous (positions, H) matrix, so F.linear is one
    # mm: a 3-D block of a strided view makes it a bmm over the rows with lm_head's weight
    # broadcast, reading the whole weight once per row (for a model without grad, as served).
    def record(into: list[tuple[int, bool]], hidden: torch.Tensor) -> None:
        into.append((hidden.shape[:-1].numel(), hidden.dim() == 2 and hidden.is_contiguous()))

    forward = scoring_forward(model, "rollserve")
    engine_blocks: list[tuple[int, bool]] = []
    original = forward.logits
    forward.logits = lambda hidden: record(engine_blocks, hidden) or original(hidden)
    try:
        ours = action_log_probs(model, sequences, mask, actions, forward_batch_size=rows_,
                                with_entropy=True, path="rollserve")  # fmt: skip
    finally:
        del forward.logits
    hf_blocks: list[tuple[int, bool]] = []
    assert _logits_head(model) is not None  # its one-off probe calls lm_head: before the hook
    hook = model.lm_head.register_forward_pre_hook(lambda _, args: record(hf_blocks, args[0]))
    try:
        theirs = action_log_probs(model, sequences, mask, actions, forward_batch_size=rows_,
                                  with_entropy=True, path="hf")  # fmt: skip
    finally:
        hook.remove()
    whole, last = divmod(actions, plan.columns)
    planned = [(rows_ * plan.columns, True)] * whole + ([(rows_ * last, True)] if last else [])
    assert len(planned) == plan.blocks
    assert engine_blocks == planned and hf_blocks == planned
    for mine, hf in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, hf, atol=1e-5, rtol=1e-5)


def test_the_default_scoring_path_can_be_hf_for_every_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DEFAULT_SCORING_PATH = "hf" keeps a model whose server adopted the engine on its HF
    forward for calls that name no path (the maker's); a named path still wins."""
    from rollserve.server.experience import scoring

    model = _built("causal_lm", "qwen2", tmp_path / "lm")
    adopt_settings(model, GenerationSettings(path="rollserve"))
    sequences, mask, actions = rows()
    calls: list[int] = []
    hook = model.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        action_log_probs(model, sequences, mask, actions, forward_batch_size=8)
        assert not calls  # "auto": the adopted engine path
        monkeypatch.setattr(scoring, "DEFAULT_SCORING_PATH", "hf")
        action_log_probs(model, sequences, mask, actions, forward_batch_size=8)
        assert calls  # the HF body ran
        calls.clear()
        action_log_probs(model, sequences, mask, actions, forward_batch_size=8, path="rollserve")
        assert not calls
    finally:
        hook.remove()
