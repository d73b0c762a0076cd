"""Tokens/s of rollserve's generate() divided by Hugging Face model.generate() on the same model.

Both sample with the same temperature / top-k / top-p, batch, prompts and budget, from a random
Llama (or a 0.5B-class Qwen2 with --model-size 0.5b-issue or 0.5b: QWEN2_05B_VOCAB) built from
a config: no download. The batch is GRPO-shaped: batch / samples_per_prompt distinct prompts,
each repeated samples_per_prompt times consecutively; HF gets the same repeated rows (what its
num_return_sequences does before its prefill), rollserve prefills each distinct prompt once and
copies its KV cache to the group.
The model has no EOS, so both produce exactly batch * new_tokens tokens per call. Repetitions
are interleaved (and their order alternated) because the machine is noisy; the ratio of
medians is the headline, target >= 2.0 with 8 samples per prompt and 256-token prompts.

    python bench/bench_generation.py                      # CPU, ~2 minutes on 2 cores
    python bench/bench_generation.py --samples-per-prompt 1 --prompt-len 64   # no sharing
    python bench/bench_generation.py --device cuda --dtype bfloat16 --model-size 0.5b-issue
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from rollserve.server.experience.generation import SamplingParams, generate, left_pad

# The Qwen2-0.5B-shaped models (24 layers, hidden 896, 14 heads / 2 KV heads, MLP 4864) by
# vocabulary and tying:
#   "0.5b-issue"  vocab 32,000, tied embeddings: 386M parameters (0.77 GB in bf16), the model
#                 issues 19 and 20 measured and set their targets on ("the case above"), and
#                 so the GPU benches' default;
#   "0.5b"        Qwen2-0.5B's own vocabulary of 151,936, untied: 630M parameters (1.26 GB), the
#                 model of every GPU figure before 2026-11-27 (bench/RESULTS.md); its lm_head and
#                 sampler are 4.75x the issue's, its scoring ~25 % more matmul work.
QWEN2_05B_VOCAB = {"0.5b-issue": (32000, True), "0.5b": (151936, False)}
MODEL_SIZES = ("small", *QWEN2_05B_VOCAB)
GPU_BENCH_MODEL = "0.5b-issue"


def build_model(size: str, vocab: int, hidden: int, layers: int, dtype: torch.dtype, device: str):
    """A random causal LM from a config: a small Llama (vocab, hidden, layers), or one of the
    Qwen2-0.5B-shaped models of QWEN2_05B_VOCAB (which ignore those three)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(pad_token_id=0, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    if size in QWEN2_05B_VOCAB:
        vocab_size, tied = QWEN2_05B_VOCAB[size]
        config = Qwen2Config(
            vocab_size=vocab_size, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
            **{**common, "tie_word_embeddings": tied},
        )  # fmt: skip
        model = Qwen2ForCausalLM(config)
    else:
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
            num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
            num_key_value_heads=max(1, hidden // 128), max_position_embeddings=4096, **common,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    return model.to(device=device, dtype=dtype).eval()


def grouped_prompts(
    batch: int, samples: int, min_len: int, max_len: int, vocab: int, seed: int
) -> list[list[int]]:
    """batch / samples distinct prompts of lengths in [min_len, max_len], each repeated
    `samples` times consecutively (a GRPO group); ragged lengths exercise left padding."""
    if batch % samples:
        raise SystemExit(f"--batch ({batch}) must be a multiple of --samples-per-prompt")
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch // samples,), generator=g)
    distinct = [torch.randint(1, vocab, (int(n),), generator=g).tolist() for n in lengths]
    return [p for p in distinct for _ in range(samples)]


def timed(fn: Callable[[], int], device: str) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (this process, all threads) and tokens of one call,
    synchronising the device around it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start, start_cpu = time.perf_counter(), time.process_time()
    tokens = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - start_cpu, tokens


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--model-size", default="small", choices=MODEL_SIZES)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="rows per call")
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256, help="longest prompt")
    parser.add_argument("--min-prompt-len", type=int, default=0, help="0: prompt-len * 3 / 4")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--path", default="auto", choices=["auto", "rollserve", "hf"],
        help="rollserve's generation path (auto: the engine on CUDA, the HF path on the CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=0,
        help="torch threads (0: torch's default); 1 avoids OpenMP barrier stalls on a busy host",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.min_prompt_len = args.min_prompt_len or max(1, args.prompt_len * 3 // 4)
    return args


def make_lanes(args: argparse.Namespace, model, prompts) -> dict[str, Callable[[], int]]:
    """The calls to time, each returning its token count: ours, HF, ours without sharing."""
    ids, mask = left_pad(prompts, 0, torch.device(args.device))
    params = SamplingParams(
        max_new_tokens=args.new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p,
    )  # fmt: skip

    def ours(share_prefill: bool = True) -> int:
        g = torch.Generator(device=args.device).manual_seed(0)
        out = generate(
            model, prompts, params, pad_token_id=0, generator=g, share_prefill=share_prefill,
            path=args.path,
        )  # fmt: skip
        return int(out.response_lengths.sum())

    # HF's defaults (top_k=50) must not leak in: pass every setting, greedy as do_sample=False.
    sampling = {"do_sample": False}
    if args.temperature > 0:
        sampling = {
            "do_sample": True, "temperature": args.temperature, "top_k": args.top_k,
            "top_p": args.top_p,
        }  # fmt: skip

    def hf() -> int:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask.long(), max_new_tokens=args.new_tokens,
                pad_token_id=0, **sampling,
            )  # fmt: skip
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    lanes = {"ours": ours, "hf": hf}
    if args.samples_per_prompt > 1:  # what sharing the prefill buys, in the same rounds
        lanes["unshared"] = lambda: ours(share_prefill=False)
    return lanes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available: skipping the GPU benchmark.")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = build_model(args.model_size, args.vocab, args.hidden, args.layers, dtype, args.device)
    vocab = model.config.vocab_size
    prompts = grouped_prompts(
        args.batch, args.samples_per_prompt, args.min_prompt_len, args.prompt_len, vocab, seed=1
    )
    lanes = make_lanes(args, model, prompts)
    for fn in lanes.values():  # warm-up: allocator, kernels, lazy imports
        fn()
    rates: dict[str, list[float]] = {name: [] for name in lanes}
    cpu_rates: dict[str, list[float]] = {name: [] for name in lanes}  # tokens per CPU-second
    for rep in range(args.reps):
        order = list(lanes)
        order = order[rep % len(order) :] + order[: rep % len(order)]  # rotate the order
        for name in order:
            seconds, cpu_seconds, tokens = timed(lanes[name], args.device)
            rates[name].append(tokens / seconds)
            cpu_rates[name].append(tokens / cpu_seconds)
    median = {name: statistics.median(r) for name, r in rates.items()}
    cpu_median = {name: statistics.median(r) for name, r in cpu_rates.items()}
    print(
        f"model={args.model_size} device={args.device} dtype={args.dtype} vocab={vocab} "
        f"batch={args.batch} samples_per_prompt={args.samples_per_prompt} "
        f"prompt_len={args.min_prompt_len}..{args.prompt_len} new_tokens={args.new_tokens} "
        f"T={args.temperature} top_k={args.top_k} top_p={args.top_p} reps={args.reps} "
        f"threads={torch.get_num_threads()} path={args.path}"
    )
    for name, r in rates.items():
        print(f"per-rep tokens/s {name:9s}", " ".join(f"{x:.0f}" for x in r))
    per_rep = [o / h for o, h in zip(rates["ours"], rates["hf"], strict=True)]
    print("per-rep ratio ours/hf:", " ".join(f"{x:.2f}" for x in per_rep))
    print("median tokens/s:", ", ".join(f"{name} {m:.0f}" for name, m in median.items()))
    # Tokens per CPU-second of this process: less sensitive to other tenants taking the cores.
    print(f"CPU-seconds ratio ours/hf = {cpu_median['ours'] / cpu_median['hf']:.3f}")
    if "unshared" in median:
        print(f"ratio unshared/hf = {median['unshared'] / median['hf']:.3f} (prefill of every row)")
    print(f"ratio ours/hf = {median['ours'] / median['hf']:.3f} (target >= 2.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
