"""Issue 22's slow trainer against a continuous rollout: read a batch, train a while, push v + 1.

    .venv/bin/python bench/subscribe_backpressure.py                  # 15 reads, 0.2 s each
    .venv/bin/python bench/subscribe_backpressure.py --windows 0 1 --reads 30 --train-s 0.5

One in-process server per window (tiny Llama built from a config, CPU, --max-staleness 1,
--rollout-queue-batches 4; 64-row batches: 32 prompts x 2 samples x 32 new tokens). Window 0 is a
client from before windows (the old contract: a batch counts as taken once gRPC accepts it).
Prints, per window: the lag of each batch read (the trainer's version minus the batch's oldest
row), and the rollout's batches made, delivered and dropped stale against the batches taken.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from rollserve.client import RolloutClient  # noqa: E402
from rollserve.server.config import ServerConfig  # noqa: E402
from rollserve.server.models import load_models  # noqa: E402
from rollserve.server.models.default_model import save_tiny_causal_lm  # noqa: E402
from rollserve.server.serving.app import RolloutServer  # noqa: E402

QUEUE = 4


def rollout_files(directory: Path) -> tuple[Path, Path]:
    prompts = directory / "prompts.jsonl"
    lines = [json.dumps({"prompt": f"q{i}=", "gt_answer": str(i)}) for i in range(64)]
    prompts.write_text("\n".join(lines) + "\n")
    template = directory / "request.json"
    template.write_text(
        json.dumps(
            {
                "samplesPerPrompt": 2,
                "sampling": {"maxNewTokens": 32, "ignoreEos": True},
                "algorithm": {"advantageEstimator": "group_norm"},
                "rewards": [{"source": "exact_match"}],
            }
        )
    )
    return prompts, template


def run(directory: Path, window: int, reads: int, train_s: float) -> dict:
    actor_dir = save_tiny_causal_lm(directory / "actor")
    models = load_models(ServerConfig(device="cpu", actor=str(actor_dir)))
    weights = {k: t.detach().clone() for k, t in models.actor.module.state_dict().items()}
    prompts, template = rollout_files(directory)
    config = ServerConfig(
        host="127.0.0.1", port=0, device="cpu", metrics_port=0, log_level="WARNING",
        rollout_prompts=str(prompts), rollout_request=str(template),
        rollout_prompts_per_batch=32, rollout_epochs=0, rollout_queue_batches=QUEUE,
    )  # fmt: skip
    lags = []
    started_s = time.monotonic()
    with RolloutServer(config, models=models) as server:
        assert server.rollout is not None
        with RolloutClient(f"127.0.0.1:{server.port}", timeout_s=300.0) as client:
            stream = client.subscribe("slow", window=window, timeout_s=300.0)
            for version in range(reads):
                batch = next(stream)
                lags.append(version - int(batch.experience.policy_version.min()))
                time.sleep(train_s)  # the trainer trains
                client.update_weights(weights, version=version + 1)
            stats = server.rollout.stats()
            stream.close()
    return {
        "window": window,
        "reads": reads,
        "lags": lags,
        "made": stats.made,
        "delivered": stats.delivered,
        "dropped_stale": stats.dropped_stale,
        "made_minus_taken": stats.made - reads,
        "bound_taken_window_queue": reads + window + QUEUE if window else None,
        "seconds": round(time.monotonic() - started_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=15)
    parser.add_argument("--train-s", type=float, default=0.2)
    parser.add_argument("--windows", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args(argv)
    print("| window | lags read (versions) | made | delivered | dropped stale | made - taken |")
    print("|---|---|---|---|---|---|")
    for window in args.windows:
        with tempfile.TemporaryDirectory(prefix="rollserve-backpressure-") as tmp:
            row = run(Path(tmp), window, args.reads, args.train_s)
        print(
            f"| {row['window']} | {row['lags']} | {row['made']} | {row['delivered']} | "
            f"{row['dropped_stale']} | {row['made_minus_taken']} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
