"""The flag table of `rollserve serve`: for every ServerConfig field, its parser, help and metavar.

Every field `foo_bar` is the flag `--foo-bar` and the variable `ROLLSERVE_FOO_BAR`. A new setting is
a field in ServerConfig (server/config.py) plus one row here (tests/test_config.py checks
that both list the same names, in the same order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import values as parse

ENV_PREFIX = "ROLLSERVE_"


@dataclass(frozen=True)
class Flag:
    """How one setting is read from text: `parse` raises argparse.ArgumentTypeError."""

    parse: Callable[[str], Any]
    help: str
    metavar: str | None = None


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


FLAGS: dict[str, Flag] = {
    "host": Flag(parse.non_empty, "address to bind", "HOST"),
    "port": Flag(parse.port, "port to bind; 0 picks a free one", "PORT"),
    "actor": Flag(
        parse.non_empty, "actor (policy) model directory; unset: built-in tiny model", "DIR"
    ),
    "reference": Flag(
        parse.non_empty, "reference model directory; unset: copy of the actor", "DIR"
    ),
    "critic": Flag(parse.non_empty, "critic (value) model directory, one label per token", "DIR"),
    "reward_model": Flag(parse.non_empty, "reward model directory, one label per sequence", "DIR"),
    "device": Flag(parse.device, "auto, cpu, mps, cuda or cuda:N", "DEVICE"),
    "dtype": Flag(
        parse.dtype, "auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16", "DTYPE"
    ),
    "generation_path": Flag(
        parse.generation_path,
        "auto (the rollserve engine for supported models on CUDA), rollserve or hf",
        "PATH",
    ),
    "kv_cache_tokens": Flag(
        parse.non_negative_int,
        "KV cache budget of the generation engine, in tokens; 0: from --gpu-memory-utilization",
        "N",
    ),
    "gpu_memory_utilization": Flag(
        parse.fraction,
        "share of total GPU memory that memory in use plus the engine's KV cache may reach",
        "F",
    ),
    "max_message_bytes": Flag(parse.byte_size, "max gRPC message size, send and receive", "BYTES"),
    "max_new_tokens": Flag(parse.positive_int, "default response token budget", "N"),
    "default_preset": Flag(parse.preset, "algorithm preset when a request names none", "NAME"),
    "generate_batch_size": Flag(parse.positive_int, "default rows per generation call", "N"),
    "forward_batch_size": Flag(parse.positive_int, "default rows per scoring forward pass", "N"),
    "micro_batch_size": Flag(parse.positive_int, "default rows per streamed Experience", "N"),
    "max_request_rows": Flag(parse.positive_int, "most prompts x samples in one request", "N"),
    "max_queue_depth": Flag(parse.positive_int, "requests queued before RESOURCE_EXHAUSTED", "N"),
    "max_prompts": Flag(parse.positive_int, "most prompts in one request", "N"),
    "max_samples_per_prompt": Flag(
        parse.positive_int, "most samples per prompt in one request", "N"
    ),
    "max_new_tokens_limit": Flag(parse.positive_int, "most max_new_tokens a request may ask", "N"),
    "max_request_tokens": Flag(
        parse.positive_int, "most rows x (prompt + new tokens) in one request", "N"
    ),
    "max_batch_tokens": Flag(
        parse.positive_int, "most rows x (prompt + new tokens) in one generation batch", "N"
    ),
    "reward_fn": Flag(parse.named, "reward source NAME=MODULE:FUNCTION", "NAME=MODULE:FUNC"),
    "reward_endpoint": Flag(
        parse.named, "reward source NAME=URL (JSON over HTTP POST)", "NAME=URL"
    ),
    # > 0: a timeout of 0 made every endpoint call fail at once (a non-blocking connect).
    "reward_timeout_s": Flag(parse.positive_seconds, "timeout of one reward endpoint call", "S"),
    "shutdown_grace_s": Flag(
        parse.seconds, "seconds in-flight calls get to finish on shutdown", "S"
    ),
    "drain_delay_s": Flag(
        parse.seconds, "seconds to report NOT_SERVING before refusing calls", "S"
    ),
    "update_idle_timeout_s": Flag(
        parse.positive_seconds,
        "end an UpdateWeights stream that sends no message for this long",
        "S",
    ),
    "weight_transports": Flag(
        parse.weight_transports,
        "UpdateWeights data planes: grpc plus any of shm, dist, cuda_ipc (on CUDA only)",
        "LIST",
    ),
    "parallel_part_wait_s": Flag(
        parse.positive_seconds, "how long one stream of a parallel update waits for the others", "S"
    ),
    "max_group_timeout_s": Flag(
        parse.positive_seconds, "cap on InitWeightsGroup's timeout_s (the rendezvous wait)", "S"
    ),
    "stream_send_timeout_s": Flag(
        parse.positive_seconds, "end a response stream whose reader takes no message this long", "S"
    ),
    "max_workers": Flag(
        parse.positive_int, "calls served at once (probes have threads of their own)", "N"
    ),
    "log_level": Flag(parse.log_level, "DEBUG, INFO, WARNING, ERROR or CRITICAL", "LEVEL"),
    "wait_for_weights": Flag(parse.boolean, "report WAITING_FOR_WEIGHTS until the first update"),
    "port_file": Flag(parse.non_empty, "write the bound port to this file once bound", "PATH"),
    "metrics_port": Flag(
        parse.port, "Prometheus metrics HTTP port on --host; 0 turns it off", "PORT"
    ),
    "tls_cert": Flag(parse.non_empty, "PEM server certificate (chain); enables TLS", "FILE"),
    "tls_key": Flag(parse.non_empty, "PEM private key of --tls-cert", "FILE"),
    "tls_client_ca": Flag(parse.non_empty, "PEM CA: require client certs it signed (mTLS)", "FILE"),
    "data_token": Flag(parse.token, "bearer token for MakeExperience and Health", "TOKEN"),
    "admin_token": Flag(
        parse.token, "bearer token for UpdateWeights (and every data call)", "TOKEN"
    ),
    "data_token_file": Flag(parse.non_empty, "read --data-token from this file", "FILE"),
    "admin_token_file": Flag(parse.non_empty, "read --admin-token from this file", "FILE"),
    "rollout_prompts": Flag(
        parse.non_empty, "JSONL prompt source of the continuous rollout (Subscribe)", "FILE"
    ),
    "rollout_request": Flag(
        parse.non_empty, "MakeExperienceRequest template without prompts, protobuf JSON", "FILE"
    ),
    "rollout_prompts_per_batch": Flag(parse.positive_int, "prompts per rollout batch", "N"),
    "rollout_epochs": Flag(parse.non_negative_int, "passes over the prompts; 0: no limit", "N"),
    "rollout_steps": Flag(parse.non_negative_int, "rollout batches to make; 0: no limit", "N"),
    "rollout_seed": Flag(parse.non_negative_int, "seed of the prompt shuffle and sampling", "N"),
    "rollout_queue_batches": Flag(
        parse.positive_int,
        "made batches held for subscribers (at most one made ahead per subscriber with a window)",
        "N",
    ),
    "max_staleness": Flag(
        parse.staleness, "drop rollout batches this many versions behind; or unlimited", "N"
    ),
}
