"""LightRFT's post-hoc masks (action_mask_rule "process_sequences"), against plain loops.

The reference below is the rule of docs/reference/experience_math.md section 3.1 written as
loops over Python lists (the upstream function's own comment describes its scatter as such a
loop); it never calls the code under test. Then the rule through the experience maker: the
returned rows are the derived ones, and the models scored them.
"""

from __future__ import annotations

import random

import pytest
import torch
from rollserve.client.protocol.errors import FailedPrecondition, InvalidArgument
from rollserve.client.protocol.experience import Experience, concat_experiences
from rollserve.client.protocol.requests import build_make_experience_request
from rollserve.server.algorithms import process_sequences, resolve_algorithm
from rollserve.server.config import ServerConfig
from rollserve.server.experience.maker import NaiveExperienceMaker
from rollserve.server.experience.request import RequestDefaults
from rollserve.server.experience.rewards import RewardRegistry
from rollserve.server.models import load_models
from rollserve.v1 import rollout_pb2 as pb

EOS, PAD = 2, 0


def loop_process_sequences(
    rows: list[list[int]], prompt_width: int, eos: int, pad: int, overwrite: bool
) -> tuple[list[list[int]], list[list[bool]], list[list[bool]], list[int]]:
    """sequences, attention, action mask and response length of each row, by loops."""
    out_seqs, out_attention, out_actions, out_lengths = [], [], [], []
    for row in rows:
        width = len(row)
        real = [token not in (eos, pad) for token in row]
        real_positions = [t for t in range(width) if real[t]]
        if not real_positions:
            end = width - 1  # upstream's argmax of an all-zero row is 0: the last column
        else:
            end = min(real_positions[-1] + 1, width - 1)
        seq = list(row)
        if overwrite or not real[end]:
            seq[end] = eos
        first = real_positions[0] if real_positions else 0
        attention = [first <= t <= end for t in range(width)]
        actions = []
        for j in range(width - prompt_width):
            state = seq[prompt_width - 1 + j]
            actions.append(j == 0 or state not in (eos, pad))
        length = max(j + 1 for j in range(len(actions)) if actions[j])
        out_seqs.append(seq)
        out_attention.append(attention)
        out_actions.append(actions)
        out_lengths.append(length)
    return out_seqs, out_attention, out_actions, out_lengths


def check_against_loops(
    rows: list[list[int]], prompt_width: int, eos: int, pad: int, overwrite: bool
) -> None:
    got = process_sequences(
        torch.tensor(rows), prompt_width, eos, pad, eos_over_last_token=overwrite
    )
    seqs, attention, actions, lengths = loop_process_sequences(
        rows, prompt_width, eos, pad, overwrite
    )
    assert got.sequences.tolist() == seqs
    assert got.attention_mask.dtype == torch.bool and got.action_mask.dtype == torch.bool
    assert got.attention_mask.tolist() == attention
    assert got.action_mask.tolist() == actions
    assert got.response_lengths.tolist() == lengths


def test_hand_worked_rows() -> None:
    """P = 3, eos 2, pad 0: [prompt | response] with the expected masks written out."""
    rows = [
        [0, 5, 6, 7, 2, 0],  # stopped on EOS: nothing written, EOS is the last action
        [3, 4, 5, 6, 7, 8],  # truncated at the last column: kept (overwritten under the quirk)
        [0, 0, 9, 1, 0, 0],  # stopped on another stop token: EOS appended after it
        [2, 4, 5, 2, 0, 0],  # EOS leads the prompt (unattended) and the response (column 0)
        [0, 4, 2, 6, 2, 0],  # EOS inside the prompt: attended, the response's state is EOS
    ]
    got = process_sequences(torch.tensor(rows), 3, EOS, PAD)
    assert got.sequences.tolist() == [
        [0, 5, 6, 7, 2, 0],
        [3, 4, 5, 6, 7, 8],
        [0, 0, 9, 1, 2, 0],
        [2, 4, 5, 2, 0, 0],
        [0, 4, 2, 6, 2, 0],
    ]
    assert got.attention_mask.int().tolist() == [
        [0, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 1, 0],
        [0, 1, 1, 1, 0, 0],
        [0, 1, 1, 1, 1, 0],
    ]
    assert got.action_mask.int().tolist() == [
        [1, 1, 0],
        [1, 1, 1],
        [1, 1, 0],
        [1, 0, 0],
        [1, 1, 0],
    ]
    assert got.response_lengths.tolist() == [2, 3, 2, 1, 2]
    quirk = process_sequences(torch.tensor(rows), 3, EOS, PAD, eos_over_last_token=True)
    assert quirk.sequences[1].tolist() == [3, 4, 5, 6, 7, 2]
    assert torch.equal(quirk.sequences[[0, 2, 3, 4]], got.sequences[[0, 2, 3, 4]])
    assert torch.equal(quirk.attention_mask, got.attention_mask)
    assert torch.equal(quirk.action_mask, got.action_mask)


def random_rows(seed: int, eos: int, pad: int, rows: int = 12) -> tuple[list[list[int]], int]:
    """Ragged rows in the generator's layout: prompts left-padded to P, responses right-padded
    to A; responses end on EOS, on another token, or fill the width (truncated). Prompts and
    responses sometimes hold EOS or pad tokens of their own (mid-prompt, mid-response)."""
    rng = random.Random(seed)
    prompt_width, actions = rng.randint(1, 5), rng.randint(1, 6)
    out = []
    for _ in range(rows):

        def token() -> int:
            return rng.choice([eos, pad]) if rng.random() < 0.15 else rng.randint(3, 30)

        prompt = [token() for _ in range(rng.randint(1, prompt_width))]
        length = rng.randint(1, actions)
        response = [token() for _ in range(length)]
        ending = rng.random()
        if ending < 0.4:
            response[-1] = eos
        elif ending < 0.5:
            response = [token() for _ in range(actions)]  # truncated: reaches the last column
        pads = [pad] * (prompt_width - len(prompt))
        out.append(pads + prompt + response + [pad] * (actions - len(response)))
    return out, prompt_width


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("pad_equals_eos", [False, True])
def test_random_ragged_rows_match_the_loops(overwrite: bool, pad_equals_eos: bool) -> None:
    eos, pad = (7, 7) if pad_equals_eos else (EOS, PAD)
    for seed in range(40):
        rows, prompt_width = random_rows(seed, eos, pad)
        check_against_loops(rows, prompt_width, eos, pad, overwrite)


@pytest.mark.gpu
def test_on_cuda_the_same_as_on_cpu() -> None:
    for seed in range(10):
        rows, prompt_width = random_rows(seed, EOS, PAD)
        for overwrite in (False, True):
            cpu = process_sequences(
                torch.tensor(rows), prompt_width, EOS, PAD, eos_over_last_token=overwrite
            )
            cuda = process_sequences(
                torch.tensor(rows, device="cuda"),
                prompt_width,
                EOS,
                PAD,
                eos_over_last_token=overwrite,
            )
            for name in ("sequences", "attention_mask", "action_mask", "response_lengths"):
                got = getattr(cuda, name)
                assert got.device.type == "cuda" and torch.equal(got.cpu(), getattr(cpu, name))


def test_rows_without_real_tokens_and_full_width_rows() -> None:
    """Edge rows: only EOS/pad tokens (upstream: EOS at the last column, all attended), and
    a batch where every row is truncated (each keeps its last token unless the quirk)."""
    check_against_loops([[2, 0, 0, 0], [0, 2, 2, 0]], 2, EOS, PAD, overwrite=False)
    check_against_loops([[2, 0, 0, 0], [0, 2, 2, 0]], 2, EOS, PAD, overwrite=True)
    full = [[4, 5, 6, 7], [0, 5, 6, 9]]
    for overwrite in (False, True):
        check_against_loops(full, 2, EOS, PAD, overwrite)
        got = process_sequences(torch.tensor(full), 2, EOS, PAD, eos_over_last_token=overwrite)
        assert got.action_mask.all()  # a truncated row's actions are all valid either way
    with pytest.raises(ValueError, match="prompt_width"):
        process_sequences(torch.tensor(full), 0, EOS, PAD)


def test_the_option_resolves_per_preset_and_the_quirk_only_for_lightrft() -> None:
    def resolve(**options: object):
        return resolve_algorithm(
            pb.AlgorithmOptions(**options), default_preset="openrlhf", has_critic=False
        )

    for preset in ("coati", "openrlhf", "lightrft"):
        assert resolve(preset=preset).action_mask_rule == "stop"
        assert resolve(preset=preset, action_mask_rule="process_sequences").action_mask_rule == (
            "process_sequences"
        )
    assert resolve(preset="lightrft", reproduce_upstream_quirks=True).eos_over_last_token
    assert not resolve(preset="lightrft").eos_over_last_token
    assert not resolve(preset="openrlhf", reproduce_upstream_quirks=True).eos_over_last_token
    with pytest.raises(InvalidArgument, match="algorithm.action_mask_rule: unknown 'eos'"):
        resolve(action_mask_rule="eos")


# ---------------------------------------------------------------------------------------------
# Through the experience maker
# ---------------------------------------------------------------------------------------------

# EOS (2) leads one prompt and sits inside another; pad (0) never occurs in a prompt here.
PROMPTS = [[5, 6, 7], [2, 9, 10, 11, 12], [40, 2, 41], [70, 71]]
MAX_NEW_TOKENS = 5
# Many single-token stops, so that some rows stop on a token that is not EOS (and, with 16
# rows of 5 tokens, some run into the budget whatever the sampler draws).
STOPS = [[t] for t in range(3, 200, 4)]


@pytest.fixture(scope="module")
def models_on(tiny_actor_dir):
    loaded: dict[str, object] = {}

    def load(device: str):
        if device not in loaded:
            config = ServerConfig(actor=str(tiny_actor_dir), device=device, dtype="float32")
            loaded[device] = load_models(config)
        return loaded[device]

    return load


def make(models, **algorithm: object) -> Experience:
    maker = NaiveExperienceMaker(
        models,
        RewardRegistry.from_specs([]),
        RequestDefaults(
            default_preset="lightrft",
            max_new_tokens=MAX_NEW_TOKENS,
            generate_batch_size=64,
            forward_batch_size=16,
            micro_batch_size=4,
            max_request_rows=4096,
        ),
    )
    request = build_make_experience_request(
        PROMPTS,
        samples_per_prompt=4,
        seed=11,
        preset="lightrft",
        algorithm={"kl_coef": 0.0, **algorithm},
        rewards=["exact_match"],
        gt_answers=["x"] * len(PROMPTS),
        max_new_tokens=MAX_NEW_TOKENS,
        stop_sequences=STOPS,
        ignore_eos=True,  # EOS does not stop rows: they end on a stop token or the budget
    )
    spec = maker.decode(request)
    return concat_experiences(list(maker.iter_experience(spec, policy_version=0)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("quirks", [False, True])
def test_the_maker_returns_and_scores_the_derived_rows(models_on, quirks: bool, device) -> None:
    """On cuda the actor generates on rollserve's engine, and the rule follows it the same."""
    models = models_on(device)
    stop = make(models, reproduce_upstream_quirks=quirks)
    derived = make(models, action_mask_rule="process_sequences", reproduce_upstream_quirks=quirks)
    # The same sampled tokens (the rule acts after generation); one generation batch, so the
    # widths are the generation's and the loops see the rows the rule saw.
    stop, derived = stop.to_device("cpu"), derived.to_device("cpu")
    rows, width = stop.sequences.tolist(), stop.prompt_width
    seqs, attention, actions, lengths = loop_process_sequences(rows, width, EOS, PAD, quirks)
    # Micro-batches drop the prompt columns no row attends: here the EOS leading prompt 1.
    cut = width - derived.prompt_width
    assert cut == 1 and not any(any(a[:cut]) for a in attention)
    assert derived.num_actions == stop.num_actions
    seqs, attention = [s[cut:] for s in seqs], [a[cut:] for a in attention]
    rows, width = [r[cut:] for r in rows], width - cut
    assert derived.sequences.tolist() == seqs
    assert derived.attention_mask.tolist() == attention
    assert derived.action_mask.tolist() == actions
    assert derived.info["response_length"].tolist() == lengths
    stopped = ~stop.info["truncated"]
    assert stopped.any() and (~stopped).any()  # both kinds of rows occur
    # Rows that stopped on a token other than EOS gained an EOS action after it; rows whose
    # last column is a real token (truncated, or stopped there) keep it but under the quirk.
    actions_width = stop.num_actions
    changed = [i for i in range(len(rows)) if seqs[i] != rows[i]]
    appended = [i for i in changed if int(stop.action_mask[i].sum()) < actions_width]
    overwritten = [i for i in changed if i not in appended]
    assert appended and all(stopped[i] for i in appended)
    assert bool(overwritten) == quirks  # some row reaches the last column here
    for i in appended:
        n = int(stop.action_mask[i].sum())  # the EOS column, right after the stop token
        assert derived.action_mask[i, n] and derived.sequences[i, width + n] == EOS
        assert int(derived.action_mask[i].sum()) == n + 1
        assert derived.rollout_log_probs[i, n] == 0  # not sampled
    for i in overwritten:
        assert derived.sequences[i, -1] == EOS != rows[i][-1]
        assert derived.action_mask[i].all()
    # The models scored the derived rows (the leading EOS of prompt 1 unattended, appended
    # EOS actions): each row's attended tokens alone through the actor give its log-probs.
    actor = models.actor.module
    tolerance = 1e-5 if device == "cpu" else 1e-4  # a batched forward against one row's
    for i in range(len(rows)):
        kept = torch.tensor(seqs[i])[torch.tensor(attention[i])]  # first real token .. EOS
        start = attention[i].index(True)
        with torch.no_grad():
            logits = actor(kept[None].to(models.device)).logits[0].float().cpu()  # (n, V)
        log_probs = torch.log_softmax(logits, dim=-1)
        for j, valid in enumerate(actions[i]):
            if valid:  # token width + j, scored by the logits of the token before it
                expected = log_probs[width + j - 1 - start, seqs[i][width + j]]
                torch.testing.assert_close(
                    derived.action_log_probs[i, j], expected, atol=tolerance, rtol=tolerance
                )


def test_a_tokenizer_without_eos_is_refused(tiny_actor_dir) -> None:
    models = load_models(ServerConfig(actor=str(tiny_actor_dir), device="cpu", dtype="float32"))
    models.tokenizer.eos_token = None
    with pytest.raises(FailedPrecondition, match="action_mask_rule"):
        make(models, action_mask_rule="process_sequences")
