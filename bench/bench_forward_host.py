"""The host's cost of the engine's full-sequence forward (prefill, scoring), on any machine.

A 24-layer Qwen2 so narrow (hidden 32) that its arithmetic is small next to what the host does
per layer (compiled calls: their guards, wrappers and launches; the eager attention between
them), compiled as the engine compiles it on CUDA (torch.compile, the token count dynamic, fused
projections; Inductor here on the CPU). The H200's scoring batch (64 rows x (128 + 256), 8
samples a prompt, MLP chunks of 4096 tokens; host-bound there, bench/RESULTS.md 2026-11-27) is
kept in its call structure by scaling the chunk with the tokens: 64 rows x (2 + 4) columns,
MLP_CHUNK_TOKENS 64.

Lanes, interleaved in one process (the first reps dropped), medians: the default (the MLP in
MLP_CALL_CHUNKS chunks a compiled call) and the baseline of a compiled MLP call per chunk
(MLP_CALL_CHUNKS = 1: the MLP's call structure before 2026-11-27), each with every row's prompt its
own and with each prompt run once for its group (scoring's shared prompts). Prints ms per
forward, the compiled calls a forward makes, and default / baseline (none set: below 1.0 is
what one call a layer buys the host; the GPU's own figure is profile_gpu.py's body table).

    python bench/bench_forward_host.py                     # ~1 minute on 2 cores
    python bench/bench_forward_host.py --layers 2 --reps 3 # the tests' smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROWS, PROMPT, RESPONSE, SAMPLES = 64, 2, 4, 8
CHUNK_TOKENS = 64  # 4096 x (64 x 6 tokens here) / (64 x 384 tokens on the H200)
VOCAB = 80


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--reps", type=int, default=20, help="measured reps per lane")
    parser.add_argument("--warm-reps", type=int, default=3, help="reps dropped first")
    return parser.parse_args(argv)


def build_forward(layers: int, directory: Path) -> tuple[object, dict[str, int]]:
    """The engine's Forward over a tiny saved-and-loaded Qwen2, compiled and fused, with its
    two compiled functions wrapped to count calls (the returned dict's "calls")."""
    import transformers as tf
    from rollserve.server.generation.families import read_family
    from rollserve.server.generation.model import Forward
    from rollserve.server.generation.rotary import RopeTable

    config = tf.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    model = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    family = read_family(model)
    assert family is not None
    forward = Forward(family, RopeTable(family.rotary, family.max_positions, torch.float32),
                      compiled=True, fused=True)  # fmt: skip
    counts = {"calls": 0}
    for name in ("_token_inputs", "_token_mlp"):
        function = getattr(forward, name)

        def counted(*args: object, function: Callable = function) -> object:
            counts["calls"] += 1
            return function(*args)

        setattr(forward, name, counted)
    return forward, counts


def rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GRPO-shaped rows: groups of SAMPLES rows with one prompt each, no padding."""
    from rollserve.server.experience.scoring import position_ids_from_mask

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (ROWS, PROMPT + RESPONSE), generator=g)
    ids[:, :PROMPT] = ids[::SAMPLES, :PROMPT].repeat_interleave(SAMPLES, 0)
    mask = torch.ones_like(ids)
    return ids, mask, position_ids_from_mask(mask)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rollserve.server.generation import model as generation_model

    torch.set_num_threads(1)  # the host's own cost, not a thread pool's
    generation_model.MLP_CHUNK_TOKENS = CHUNK_TOKENS
    default_chunks = generation_model.MLP_CALL_CHUNKS
    lanes = {"default": default_chunks, "a call per chunk": 1}
    reps = f"{args.reps} reps after {args.warm_reps}"
    print(f"# {args.layers}-layer Qwen2, hidden 32, {ROWS} rows x ({PROMPT} + {RESPONSE}), "
          f"{SAMPLES} samples a prompt; MLP chunks of {CHUNK_TOKENS} tokens; default "
          f"{default_chunks} chunks a compiled call; {reps}")  # fmt: skip
    with tempfile.TemporaryDirectory() as directory:
        forward, counts = build_forward(args.layers, Path(directory))
        ids, mask, positions = rows()
        times: dict[tuple[str, int], list[float]] = {}
        calls: dict[tuple[str, int], int] = {}
        with torch.inference_mode():
            for rep in range(args.warm_reps + args.reps):
                for lane, chunks in lanes.items():
                    generation_model.MLP_CALL_CHUNKS = chunks
                    for shared in (0, PROMPT):
                        counts["calls"] = 0
                        start = time.perf_counter()
                        forward.hidden_states(ids, mask, positions, shared)
                        seconds = time.perf_counter() - start
                        calls[lane, shared] = counts["calls"]
                        if rep >= args.warm_reps:
                            times.setdefault((lane, shared), []).append(seconds * 1e3)
    print("\n| lane | prompts | ms per forward (median) | min | compiled calls per forward |")
    print("| --- | --- | --- | --- | --- |")
    for (lane, shared), values in times.items():
        prompts = "run once a group" if shared else "each row's own"
        print(f"| {lane} | {prompts} | {statistics.median(values):.1f} | {min(values):.1f} | "
              f"{calls[lane, shared]} |")  # fmt: skip
    for shared in (0, PROMPT):
        ratio = statistics.median(times["default", shared]) / statistics.median(
            times["a call per chunk", shared]
        )
        prompts = "shared prompts" if shared else "own prompts"
        print(f"default / a call per chunk ({prompts}): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
