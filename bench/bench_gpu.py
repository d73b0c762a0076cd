"""Generation on a GPU: Hugging Face `generate` against rollserve's engine, on the same rows.

The model is the random Qwen2-0.5B-shaped model of bench_generation.py (no download), in
bfloat16. Rows are GRPO-shaped (distinct prompts x samples per prompt); the model has no EOS,
so every lane produces rows x new_tokens tokens. Per case it prints tokens/s of HF `generate`
(dynamic cache, sampling at temperature 1 with top-k and top-p off) and of the engine:
with CUDA graphs and its compiled layers and sampler (the default on CUDA), after a warm-up
call on dummy prompts of the same shape (engine_warm_up: what a server runs before it reports
SERVING), with graphs only (engine_uncompiled) and with neither (engine_eager); first call and
steady state, and the peak memory the caching allocator saw. A failing lane prints its error
and the run goes on. One command, under 8 minutes on one H100/H200:

    python bench/bench_gpu.py
    python bench/bench_gpu.py --device cpu --quick     # a smoke test of the script (< 1 min)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generation import build_model, grouped_prompts  # noqa: E402
from rollserve.server.experience.generation import SamplingParams, generate, left_pad  # noqa: E402
from rollserve.server.generation import Engine, engine_for, read_family  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    prompts: int
    samples: int
    prompt_len: int
    new_tokens: int


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("quick 4x2", 4, 2, 16, 16), Case("quick 8x4", 8, 4, 24, 24)]
    return [Case("batch 32", 4, 8, 128, 256), Case("64 prompts x 8", 64, 8, 128, 256)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], None], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def memory(device: str) -> str:
    if not device.startswith("cuda"):
        return "-"
    gib = 1 << 30
    allocated = torch.cuda.max_memory_allocated() / gib
    return f"{allocated:.1f}/{torch.cuda.max_memory_reserved() / gib:.1f} GiB"


def reset_memory(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def lanes(model, case: Case, device: str) -> dict[str, Callable[[], None]]:
    vocab = model.config.vocab_size
    prompts = grouped_prompts(
        case.prompts * case.samples, case.samples, case.prompt_len, case.prompt_len, vocab, 1
    )
    ids, mask = left_pad(prompts, 0, torch.device(device))
    params = SamplingParams(max_new_tokens=case.new_tokens, temperature=1.0)
    family = read_family(model)
    plain = Engine(model, family, compiled=False)
    eager = Engine(model, family, cuda_graphs=False, compiled=False)

    def hf() -> None:
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=mask.long(), max_new_tokens=case.new_tokens,
                do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, pad_token_id=0,
            )  # fmt: skip

    def engine_warm_up() -> None:  # what a server would run before reporting SERVING
        engine_for(model, "rollserve").warm_up(params, len(prompts), ids.shape[1], pad_token_id=0)

    def engine() -> None:
        g = torch.Generator(device=device).manual_seed(0)
        generate(model, prompts, params, pad_token_id=0, generator=g, path="rollserve")

    def engine_uncompiled() -> None:
        g = torch.Generator(device=device).manual_seed(0)
        plain.generate(ids, mask, params, pad_token_id=0, generator=g)

    def engine_eager() -> None:
        g = torch.Generator(device=device).manual_seed(0)
        eager.generate(ids, mask, params, pad_token_id=0, generator=g)

    return {
        "hf": hf, "engine_warm_up": engine_warm_up, "engine": engine,
        "engine_uncompiled": engine_uncompiled,
        "engine_eager": engine_eager,
    }  # fmt: skip


def run_case(model, case: Case, device: str, reps: int) -> list[list[str]]:
    """One table row per lane: case, lane, tokens/s, first and steady seconds, peak memory,
    ratio to HF; a failing lane's row carries its error."""
    tokens = case.prompts * case.samples * case.new_tokens
    rows: list[list[str]] = []
    hf_rate = None
    for name, fn in lanes(model, case, device).items():
        try:
            reset_memory(device)
            first = timed(fn, device)
            if name == "engine_warm_up":  # once: its cost is the first call's
                rows.append([case.name, name, "-", f"{first:.2f}", "-", memory(device), "-"])
                print(" | ".join(rows[-1]), flush=True)
                continue
            count = 1 if name == "engine_eager" else reps
            steady = statistics.median(timed(fn, device) for _ in range(count))
        except Exception as error:  # noqa: BLE001 - one failing lane must not end the run
            traceback.print_exc()
            rows.append([case.name, name, f"FAILED {type(error).__name__}: {error}"[:160]])
            print(" | ".join(rows[-1]), flush=True)
            continue
        rate = tokens / steady
        hf_rate = rate if name == "hf" else hf_rate
        ratio = f"{rate / hf_rate:.2f}x" if hf_rate else "-"
        rows.append([case.name, name, f"{rate:,.0f}", f"{first:.2f}", f"{steady:.2f}",
                     memory(device), ratio])  # fmt: skip
        print(" | ".join(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="a small model and batch (smoke test)")
    parser.add_argument("--reps", type=int, default=3, help="steady-state calls per lane")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available: nothing to measure (try --device cpu --quick).")
        return 0
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    size = "small" if args.quick else "0.5b"
    start = time.perf_counter()
    model = build_model(size, 512, 64, 2, dtype, args.device)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device {name}, torch {torch.__version__}, model {size} {dtype}, "
          f"built in {time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
    header = ["case", "lane", "tokens/s", "first s", "steady s", "peak alloc/reserved", "vs hf"]
    print(f"tokens per call = rows x new tokens; steady = median of {args.reps}", flush=True)
    rows = [
        row for case in cases(args.quick) for row in run_case(model, case, args.device, args.reps)
    ]
    print("\n| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
