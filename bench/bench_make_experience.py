"""Wall time of MakeExperience over gRPC divided by the same work in-process; target <= 1.05.

The server is an in-process RolloutServer on 127.0.0.1:0 serving a small random Llama built from
a config (hidden 256, 4 layers, a 16k word-level vocabulary), saved to a temporary directory and
loaded back with from_pretrained, like a production checkpoint. The reference model is the
server's default frozen copy of the actor. One request is a GRPO-style batch: 32 prompts x 4
samples, 64 new tokens, group_norm advantages, KL against the reference, an exact_match rule
reward (so every response is decoded).

    in-process: server.runtime.maker.make_experience(prompts, **options)
    gRPC:       RolloutClient.make_experience(prompts, **options) from a client in another
                process (default) or thread, timed there: request, stream, decode, concat.

Both run the same seed, so they do exactly the same work. Repetitions are interleaved, their
order alternated each round; the ratio of medians is the headline. Because a wall-clock ratio on
a small shared machine mostly measures the scheduler, the script also prints the CPU time of
the work only the gRPC path does (encode + serialize on the server, parse + decode on the
client) and of the concat both paths do, measured on this request's own micro-batches.

    python bench/bench_make_experience.py                 # CPU: a few minutes on 2 cores
    python bench/bench_make_experience.py --client thread --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch


def save_tokenizer(directory: Path, vocab: int) -> None:
    """A word-level tokenizer of `vocab` ids ("<pad>" 0, "<s>" 1, "</s>" 2, then "w3" ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(directory)


def save_model(directory: Path, vocab: int, hidden: int, layers: int) -> Path:
    """A random Llama and a word-level tokenizer of `vocab` ids saved to `directory`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128), max_position_embeddings=2048,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    save_tokenizer(directory, vocab)
    return directory


def workload(args: argparse.Namespace) -> tuple[list[list[int]], dict]:
    """Prompts of 16..64 tokens and the request options (one fixed seed: identical work)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 65, (args.prompts,), generator=g)
    prompts = [torch.randint(3, args.vocab, (int(n),), generator=g).tolist() for n in lengths]
    options = dict(
        samples_per_prompt=args.samples,
        max_new_tokens=args.new_tokens,
        seed=1234,
        algorithm={"advantage_estimator": "group_norm"},
        rewards=["exact_match"],
        gt_answers=[f"w{i + 3}" for i in range(args.prompts)],
    )
    return prompts, options


def codec_overhead_s(maker, prompts, options) -> dict[str, float]:
    """Thread CPU seconds of each wire step for this request's micro-batches (best of 3)."""
    from rollserve.client.protocol.experience import (
        concat_experiences,
        experience_from_proto,
        experience_to_proto,
    )
    from rollserve.client.protocol.requests import build_make_experience_request
    from rollserve.v1 import rollout_pb2 as pb

    spec = maker.decode(build_make_experience_request(prompts, **options))
    batches = list(maker.iter_experience(spec, policy_version=0))
    best: dict[str, float] = {}
    for _ in range(3):
        t0 = time.thread_time()
        wire = [
            pb.MakeExperienceResponse(experience=experience_to_proto(b)).SerializeToString()
            for b in batches
        ]
        t1 = time.thread_time()
        got = [
            experience_from_proto(pb.MakeExperienceResponse.FromString(m).experience) for m in wire
        ]
        t2 = time.thread_time()
        concat_experiences(got)
        t3 = time.thread_time()
        for key, seconds in (("encode", t1 - t0), ("decode", t2 - t1), ("concat", t3 - t2)):
            best[key] = min(best.get(key, seconds), seconds)
    best["bytes"] = float(sum(len(m) for m in wire))
    best["messages"] = float(len(wire))
    return best


def phases_s(e) -> float:
    """Seconds the server spent in the phases of making `e` (info time/<phase>_s summed over
    rows and phases): the rest of a call's wall time is the path around them."""
    from rollserve.server.experience.timing import PHASES, phase_key

    keys = [phase_key(phase) for phase in PHASES]
    return sum(float(e.info[key].double().sum()) for key in keys if key in e.info)


def client_process(address: str, prompts, options, jobs, results) -> None:
    """Time one gRPC make_experience per job, in this process (the trainer's side)."""
    from rollserve.client.client import RolloutClient

    torch.set_num_threads(1)  # the client does no math worth a thread pool
    with RolloutClient(address, timeout_s=600) as client:
        while jobs.get() is not None:
            start_s, cpu_s = time.perf_counter(), time.process_time()
            e = client.make_experience(prompts, **options)
            wall_s = time.perf_counter() - start_s
            cpu_s = time.process_time() - cpu_s
            results.put((wall_s, cpu_s, tuple(e.sequences.shape), phases_s(e)))


@dataclass(frozen=True)
class Timing:
    wall_s: float
    cpu_s: float  # CPU seconds of every thread involved (server and client processes)
    shape: tuple[int, ...]
    phases_s: float  # of which in the server's phases (generate, score, rewards, shape, ...)


class GrpcRunner:
    """Runs timed gRPC calls in a client process or thread."""

    def __init__(self, mode: str, address: str, prompts, options) -> None:
        ctx = mp.get_context("spawn")
        queue_type = ctx.Queue if mode == "process" else queue.Queue
        self.jobs, self.results = queue_type(), queue_type()
        args = (address, prompts, options, self.jobs, self.results)
        if mode == "process":
            self.worker = ctx.Process(target=client_process, args=args, daemon=True)
        else:
            self.worker = threading.Thread(target=client_process, args=args, daemon=True)
        self.worker.start()

    def __call__(self) -> Timing:
        server_cpu_s = time.process_time()
        self.jobs.put(1)
        wall_s, client_cpu_s, shape, phases = self.results.get(timeout=900)
        server_cpu_s = time.process_time() - server_cpu_s
        # In thread mode the client's CPU is already inside this process's.
        cpu_s = server_cpu_s + (client_cpu_s if isinstance(self.worker, mp.Process) else 0.0)
        return Timing(wall_s, cpu_s, shape, phases)

    def close(self) -> None:
        self.jobs.put(None)
        self.worker.join(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--client", choices=("process", "thread"), default="process")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from rollserve.server.config import ServerConfig
    from rollserve.server.models import load_models
    from rollserve.server.serving.app import RolloutServer

    with tempfile.TemporaryDirectory(prefix="bench-me-") as tmp:
        model_dir = save_model(Path(tmp), args.vocab, args.hidden, args.layers)
        config = ServerConfig(
            host="127.0.0.1", port=0, actor=str(model_dir), device=args.device,
            log_level="WARNING", metrics_port=0,
        )  # fmt: skip
        server = RolloutServer(config, models=load_models(config))
        server.start()
    maker = server.runtime.maker
    prompts, options = workload(args)
    runner = GrpcRunner(args.client, server.address, prompts, options)

    def in_process() -> Timing:
        start_s, cpu_s = time.perf_counter(), time.process_time()
        e = maker.make_experience(prompts, **options)
        wall_s = time.perf_counter() - start_s
        cpu_s = time.process_time() - cpu_s
        return Timing(wall_s, cpu_s, tuple(e.sequences.shape), phases_s(e))

    print(
        f"# {args.prompts} prompts x {args.samples} samples, {args.new_tokens} new tokens, "
        f"Llama hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, "
        f"device {args.device}, torch threads {torch.get_num_threads()}, client {args.client}"
    )
    warm = (in_process(), runner())  # first calls pay one-time costs (allocator, kernels)
    print(f"warm-up: in-process {warm[0].wall_s:.2f} s, grpc {warm[1].wall_s:.2f} s")
    local: list[Timing] = []
    remote: list[Timing] = []
    for round_index in range(args.rounds):
        order = (in_process, runner) if round_index % 2 == 0 else (runner, in_process)
        timings = {fn: fn() for fn in order}
        a, b = timings[in_process], timings[runner]
        assert a.shape == b.shape, "the two paths did different work"
        local.append(a)
        remote.append(b)
        print(
            f"round {round_index}: in-process {a.wall_s:.3f} s ({a.cpu_s:.2f} CPU s)  "
            f"grpc {b.wall_s:.3f} s ({b.cpu_s:.2f} CPU s)  ratio {b.wall_s / a.wall_s:.3f}"
        )
    runner.close()
    overhead = codec_overhead_s(maker, prompts, options)
    server.stop(0)
    median_local_s = statistics.median(t.wall_s for t in local)
    median_remote_s = statistics.median(t.wall_s for t in remote)
    wire_share = (overhead["encode"] + overhead["decode"]) / median_local_s
    print(
        f"gRPC-only work per call: encode {overhead['encode'] * 1e3:.1f} ms, decode "
        f"{overhead['decode'] * 1e3:.1f} ms ({int(overhead['messages'])} messages, "
        f"{overhead['bytes'] / 1e6:.2f} MB); concat (both paths) "
        f"{overhead['concat'] * 1e3:.1f} ms; encode + decode = {wire_share:.2%} of in-process"
    )
    outside = [
        statistics.median(t.wall_s - t.phases_s for t in lane) * 1e3 for lane in (local, remote)
    ]
    print(
        f"outside the phases (median): in-process {outside[0]:.1f} ms, grpc {outside[1]:.1f} ms; "
        f"phases: in-process {statistics.median(t.phases_s for t in local):.3f} s, grpc "
        f"{statistics.median(t.phases_s for t in remote):.3f} s"
    )
    cpu_ratio = statistics.median(t.cpu_s for t in remote) / statistics.median(
        t.cpu_s for t in local
    )
    per_round = statistics.median(r.wall_s / a.wall_s for r, a in zip(remote, local, strict=True))
    print(
        f"median in-process {median_local_s:.3f} s, grpc {median_remote_s:.3f} s: "
        f"ratio of medians {median_remote_s / median_local_s:.3f} (median of per-round ratios "
        f"{per_round:.3f}; CPU-seconds ratio {cpu_ratio:.3f}; target <= 1.05)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
