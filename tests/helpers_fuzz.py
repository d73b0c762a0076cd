"""Malformed requests for every Rollout RPC, sent as raw bytes through generic gRPC calls.

Shared by the in-suite fuzz (tests/test_fuzz.py, a small fixed-seed sample) and the long
campaign (bench/soak.py, 10,000+ requests). Every case is built from a `random.Random` with a
fixed seed, so a failing case is replayed by its (seed, index). A case is one call: the method,
its request bytes (one message, or a list for the UpdateWeights stream) and a category name used
in the report. `run_case` sends it with a deadline and returns the status code and details.

What "passes": INVALID_ARGUMENT, FAILED_PRECONDITION or RESOURCE_EXHAUSTED with a non-empty
message, or OK where a mutation happens to leave a valid request (bit flips can). Never INTERNAL
or UNKNOWN, never a deadline (a hang), never a dead server. The UpdateWeights streams always
carry the server's current weights (bytes identical to what it serves) with a CRC-32 on every
chunk and the file's SHA-256, so a stream that is accepted despite a mutation still leaves the
weights bit for bit as they were; only the version moves, and the caller counts those.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import grpc
import torch
from rollserve.client.protocol.wire import crc32, encode_chunk
from rollserve.client.weights.update_file import update_weights_messages
from rollserve.v1 import rollout_pb2 as pb

__all__ = [
    "ACCEPTABLE",
    "Case",
    "FuzzReport",
    "Outcome",
    "base_experience_request",
    "fuzz_cases",
    "run_case",
]

SERVICE = "/rollserve.v1.Rollout/"
# Codes a malformed request may get; OK where a mutation left a valid request.
ACCEPTABLE = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
# The weights-group RPCs also answer UNAVAILABLE (a rendezvous that cannot reach the trainer's
# store: retry) and NOT_FOUND (no group of that name).
_GROUP_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND})
_ALSO_ACCEPTABLE = {"InitWeightsGroup": _GROUP_CODES, "DestroyWeightsGroup": _GROUP_CODES}
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1
_BAD_FLOATS = (math.nan, math.inf, -math.inf, -1.0, 1e38, -1e38, 1e-45)
_BAD_INTS = (-1, 0, -(2**31), INT32_MAX, 100_000)
_BAD_NAMES = (
    "",
    "no-such-name",
    "os:system",
    "subprocess:run",
    "__import__('os').system('true')",
    "http://169.254.169.254/latest/meta-data/",
    "file:///etc/passwd",
    "../../../../etc/passwd",
    "\x00\xff\ud7ff",
    "A" * 70_000,
)


@dataclass(frozen=True)
class Case:
    """One call: `kind` is unary_stream, stream_unary or unary_unary; stream requests a list."""

    category: str
    method: str
    kind: str
    request: bytes | tuple[bytes, ...]
    note: str = ""


@dataclass(frozen=True)
class Outcome:
    case: Case
    code: grpc.StatusCode
    details: str
    seconds: float

    @property
    def acceptable(self) -> bool:
        if self.code not in ACCEPTABLE | _ALSO_ACCEPTABLE.get(self.case.method, frozenset()):
            return False
        if "metadata size exceeds" in self.details:  # the real status was lost in transit
            return False
        return self.code is grpc.StatusCode.OK or bool(self.details.strip())


@dataclass
class FuzzReport:
    """Counts per category and code, the slowest call, and every unacceptable outcome."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    bad: list[Outcome] = field(default_factory=list)
    accepted_updates: int = 0
    slowest_s: float = 0.0

    def add(self, outcome: Outcome) -> None:
        by_code = self.counts.setdefault(outcome.case.category, {})
        by_code[outcome.code.name] = by_code.get(outcome.code.name, 0) + 1
        self.slowest_s = max(self.slowest_s, outcome.seconds)
        if outcome.case.method == "UpdateWeights" and outcome.code is grpc.StatusCode.OK:
            self.accepted_updates += 1
        if not outcome.acceptable:
            self.bad.append(outcome)

    @property
    def total(self) -> int:
        return sum(sum(codes.values()) for codes in self.counts.values())

    def code_total(self, name: str) -> int:
        return sum(codes.get(name, 0) for codes in self.counts.values())


def run_case(channel: grpc.Channel, case: Case, timeout_s: float) -> Outcome:
    """Send one case and wait for its status (streamed responses are drained)."""
    method = SERVICE + case.method
    started_s = time.monotonic()
    try:
        if case.kind == "unary_stream":
            call = channel.unary_stream(method)(case.request, timeout=timeout_s)
            for _ in call:
                pass
        elif case.kind == "stream_unary":
            channel.stream_unary(method)(iter(case.request), timeout=timeout_s)
        else:
            channel.unary_unary(method)(case.request, timeout=timeout_s)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as error:
        code, details = error.code(), error.details() or ""
    return Outcome(case, code, details, time.monotonic() - started_s)


# ---- MakeExperience -----------------------------------------------------------------------------


def base_experience_request() -> pb.MakeExperienceRequest:
    """A small valid request (2 prompts x 2 samples, 2 new tokens): what mutations start from."""
    request = pb.MakeExperienceRequest(samples_per_prompt=2, request_id="fuzz")
    request.token_ids.values.extend([1, 72, 101, 1, 50])
    request.token_ids.lengths.extend([3, 2])
    request.sampling.max_new_tokens = 2
    request.sampling.temperature = 1.0
    request.sampling.seed = 3
    request.rewards.add(source="exact_match", weight=1.0)
    request.gt_answers.extend(["a", "b"])
    request.algorithm.advantage_estimator = "group_norm"
    return request


def _set(path: str, value: object) -> Callable[[pb.MakeExperienceRequest], None]:
    def mutate(request: pb.MakeExperienceRequest) -> None:
        *parents, name = path.split(".")
        message = request
        for parent in parents:
            message = getattr(message, parent)
        setattr(message, name, value)

    mutate.__name__ = f"{path}={value!r}"[:80]
    return mutate


def _token_ids(values: list[int], lengths: list[int]) -> Callable[[pb.MakeExperienceRequest], None]:
    def mutate(request: pb.MakeExperienceRequest) -> None:
        request.token_ids.Clear()
        request.token_ids.values.extend(values)
        request.token_ids.lengths.extend(lengths)
        del request.gt_answers[:]

    mutate.__name__ = f"token_ids(values={len(values)}, lengths={lengths[:4]})"
    return mutate


def _products(batch_field: str) -> Callable[[pb.MakeExperienceRequest], None]:
    def mutate(request: pb.MakeExperienceRequest) -> None:
        _token_ids([5] * 4096, [1] * 4096)(request)
        request.gt_answers.extend(["1"] * 4096)
        request.samples_per_prompt = 1
        request.sampling.max_new_tokens = 500
        setattr(request.batching, batch_field, 4096)

    mutate.__name__ = f"4096 prompts x 500 new tokens, {batch_field}=4096"
    return mutate


def _texts(texts: list[str], chat: bool = False) -> Callable[[pb.MakeExperienceRequest], None]:
    def mutate(request: pb.MakeExperienceRequest) -> None:
        request.texts.texts.extend(texts)
        request.texts.apply_chat_template = chat
        del request.gt_answers[:]

    mutate.__name__ = f"texts({len(texts)} x {len(texts[0]) if texts else 0} chars)"
    return mutate


def _append(
    path: str, make: Callable[[object], None]
) -> Callable[[pb.MakeExperienceRequest], None]:
    def mutate(request: pb.MakeExperienceRequest) -> None:
        message = request
        for parent in path.split("."):
            message = getattr(message, parent)
        make(message)

    mutate.__name__ = f"append({path})"
    return mutate


def _experience_mutations(vocab_size: int) -> list[Callable[[pb.MakeExperienceRequest], None]]:
    mutations: list[Callable[[pb.MakeExperienceRequest], None]] = []
    for value in _BAD_INTS + (257, 4097):
        mutations.append(_set("samples_per_prompt", value))
        mutations.append(_set("sampling.max_new_tokens", value))
        mutations.append(_set("sampling.min_new_tokens", value))
        mutations.append(_set("sampling.top_k", value))
        mutations.append(_set("algorithm.overlong_buffer", value))
        for name in ("micro_batch_size", "generate_batch_size", "forward_batch_size"):
            mutations.append(_set(f"batching.{name}", value))
    for value in _BAD_FLOATS + (0.0, 1.5):
        mutations.append(_set("sampling.temperature", value))
        mutations.append(_set("sampling.top_p", value))
        for name in (
            "gamma",
            "lam",
            "kl_coef",
            "kl_clamp",
            "reward_clip",
            "advantage_clip",
            "group_std_eps",
            "high_entropy_token_ratio",
            "overlong_factor",
            "clip_filter_eps",
        ):
            mutations.append(_set(f"algorithm.{name}", value))
    for value in _BAD_NAMES:
        for name in (
            "preset",
            "advantage_estimator",
            "kl_estimator",
            "kl_mode",
            "reward_placement",
            "whitening",
        ):
            mutations.append(_set(f"algorithm.{name}", value))
        mutations.append(_append("rewards", lambda r, v=value: r.add(source=v)))
        mutations.append(_append("sampling.stop_strings", lambda s, v=value: s.append(v)))
        mutations.append(_set("request_id", value))
    for weight in _BAD_FLOATS:
        mutations.append(
            _append("rewards", lambda r, w=weight: r.add(source="exact_match", weight=w))
        )
    mutations += [
        _set("min_policy_version", UINT64_MAX),
        _set("min_policy_version", 1),
        _set("outputs.action_entropy", True),
        _set("outputs.response_texts", True),
        _set("algorithm.kl_coef", 0.1),  # needs a reference model: loaded by default
        _set("algorithm.advantage_estimator", "gae"),  # needs a critic: none loaded
        _set("algorithm.advantage_estimator", "rloo"),
        _append("gt_answers", lambda g: g.append("extra")),
        _append("gt_answers", lambda g: g.append("x" * 100_000)),
        _append("rewards", lambda r: r.add(source="reward_model")),  # no reward model loaded
        _append("sampling.stop_sequences", lambda s: s.add()),  # an empty stop sequence
        _append("sampling.stop_sequences", lambda s: s.add(token_ids=[vocab_size])),
        _append("sampling.stop_sequences", lambda s: s.add(token_ids=[-1, 5])),
        _append("sampling.stop_sequences", lambda s: s.add(token_ids=[3] * 10_000)),
        _append("sampling.stop_strings", lambda s: s.extend(["z"] * 20_000)),
        _token_ids([], []),
        _token_ids([1], [0]),
        _token_ids([1, 2], [-1, 3]),
        _token_ids([1, 2, 3], [1]),
        _token_ids([1], [5]),
        _token_ids([vocab_size], [1]),
        _token_ids([-1], [1]),
        _token_ids([INT32_MAX], [1]),
        _token_ids([-(2**31)], [1]),
        _token_ids([5] * 600, [600]),  # longer than the context
        _token_ids([5] * 100_000, [100_000]),
        _token_ids([5] * 5000, [1] * 5000),  # over --max-prompts
        _token_ids([5] * 4096, [1] * 4096),  # at --max-prompts: x samples over the row limit
        _token_ids([5, 6], [INT32_MAX, -(2**31) + 3]),  # lengths that wrap around in int32
        _products("generate_batch_size"),  # each count legal, together 2 Mi tokens in one batch
        _products("forward_batch_size"),
        _texts([]),
        _texts([""]),
        _texts(["\x00"]),
        _texts(["hello", ""]),
        _texts(["hi"], chat=True),  # the byte tokenizer has no chat template
        _texts(["\ud7ff\uffff" * 10]),
        _texts(["x" * 2_000_000]),  # tokenizes to 2M tokens: over the context
        _texts(["x"] * 5000),
    ]
    return mutations


def _mutated_experience(rng: random.Random, mutations: list) -> tuple[bytes, str]:
    request = base_experience_request()
    chosen = rng.sample(mutations, rng.choice((1, 1, 1, 2, 3)))
    for mutate in chosen:
        try:
            mutate(request)
        except (ValueError, TypeError):  # not representable (e.g. a bad surrogate): skip it
            pass
    return request.SerializeToString(), "; ".join(m.__name__ for m in chosen)


# ---- raw bytes ----------------------------------------------------------------------------------


def _random_bytes(rng: random.Random) -> bytes:
    size = rng.choice((0, 1, 2, 5, 17, 64, 300, 4096))
    return rng.randbytes(size)


def _bit_flips(rng: random.Random, data: bytes, flips: int | None = None) -> bytes:
    if not data:
        return bytes([1 << rng.randrange(8)])
    out = bytearray(data)
    for _ in range(flips or rng.choice((1, 1, 2, 4))):
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def _valid_unary(method: str) -> bytes:
    if method == "MakeExperience":
        return base_experience_request().SerializeToString()
    if method == "Subscribe":
        return pb.SubscribeRequest(subscriber_id="fuzz", max_batches=1).SerializeToString()
    if method == "InitWeightsGroup":
        # Invalid twice over (port 0, rank 0), so no flip makes the server wait for a rendezvous.
        request = pb.InitWeightsGroupRequest(
            group="g", master_address="127.0.0.1", master_port=0, world_size=2, rank=0
        )
        request.timeout_s = 0.2
        return request.SerializeToString()
    if method == "DestroyWeightsGroup":
        return pb.DestroyWeightsGroupRequest(group="no-such-group").SerializeToString()
    return pb.HealthRequest().SerializeToString()


_UNARY = (
    ("MakeExperience", "unary_stream"),
    ("Health", "unary_unary"),
    ("Subscribe", "unary_stream"),
    ("InitWeightsGroup", "unary_unary"),
    ("DestroyWeightsGroup", "unary_unary"),
)


# ---- UpdateWeights ------------------------------------------------------------------------------


class WeightsStreams:
    """UpdateWeights streams of `state_dict` (the server's current weights) and lies about them."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], chunk_bytes: int = 256 * 1024):
        self.state_dict = dict(state_dict)
        self.chunk_bytes = chunk_bytes
        messages = list(
            update_weights_messages(
                self.state_dict,
                target="actor",
                version=1,
                mode="full",
                chunk_bytes=chunk_bytes,
                crc32=True,
                sha256=True,
            )
        )
        self.header = pb.UpdateWeightsRequest.FromString(messages[0]).header
        self.file = b"".join(pb.UpdateWeightsRequest.FromString(m).chunk.data for m in messages[1:])
        prefix = int.from_bytes(self.file[:8], "little")
        self.json_header: dict = json.loads(self.file[8 : 8 + prefix])
        self.data = self.file[8 + prefix :]

    def messages(
        self,
        version: int,
        *,
        file: bytes | None = None,
        header: Callable[[pb.WeightsHeader], None] | None = None,
        chunk_bytes: int | None = None,
        crc: bool = True,
    ) -> list[bytes]:
        """A header then chunks of `file`; total_bytes and sha256 describe `file` unless edited."""
        file = self.file if file is None else file
        message = pb.WeightsHeader()
        message.CopyFrom(self.header)
        message.version = version
        message.total_bytes = len(file)
        message.sha256 = hashlib.sha256(file).hexdigest()
        if file is not self.file:
            del message.manifest[:]
        if header is not None:
            header(message)
        step = chunk_bytes or self.chunk_bytes
        chunks = [
            encode_chunk(
                offset,
                [file[offset : offset + step]],
                crc32(file[offset : offset + step]) if crc else None,
            )
            for offset in range(0, len(file), step)
        ]
        return [pb.UpdateWeightsRequest(header=message).SerializeToString(), *chunks]

    def file_with_header(
        self, document: object, *, prefix: int | None = None, data: bytes | None = None
    ) -> bytes:
        raw = json.dumps(document).encode() if not isinstance(document, bytes) else document
        size = len(raw) if prefix is None else prefix
        return struct.pack("<Q", size) + raw + (self.data if data is None else data)


def _lying_documents(
    streams: WeightsStreams, rng: random.Random
) -> list[tuple[str, object, bytes | None]]:
    """(note, JSON header document, data section or None for the real one)."""
    doc = streams.json_header
    names = [n for n in doc if n != "__metadata__"]
    name = rng.choice(names)
    entry = doc[name]

    def edited(**changes: object) -> dict:
        copy = json.loads(json.dumps(doc))
        copy[name].update(changes)
        return copy

    renamed = json.loads(json.dumps(doc))
    renamed["model.no_such_layer.weight"] = renamed.pop(name)
    missing = json.loads(json.dumps(doc))
    del missing[name]
    begin, end = entry["data_offsets"]
    numel = math.prod(entry["shape"])
    return [
        ("unknown tensor name", renamed, None),
        ("a tensor missing", missing, None),
        (
            "wrong shape",
            edited(shape=[numel, 1] if len(entry["shape"]) != 2 else entry["shape"][::-1] + [1]),
            None,
        ),
        ("wrong dtype I32", edited(dtype="I32"), None),
        ("wrong dtype BOOL", edited(dtype="BOOL", shape=[end - begin]), None),
        ("unsupported dtype", edited(dtype="F8_E4M3"), None),
        ("negative dim", edited(shape=[-1, numel]), None),
        ("huge shape", edited(shape=[2**40, 2**40]), None),
        ("offsets past the data", edited(data_offsets=[begin, end + 2**50]), None),
        ("offsets reversed", edited(data_offsets=[end, begin]), None),
        ("offsets as floats", edited(data_offsets=[float(begin), float(end)]), None),
        ("shape as strings", edited(shape=[str(d) for d in entry["shape"]]), None),
        ("extra key", edited(extra=1), None),
        ("not an object", [1, 2, 3], None),
        ("metadata not strings", {**doc, "__metadata__": {"a": 1}}, None),
        ("empty header", {}, b""),
        ("NaN in the data", doc, _nan_data(streams, entry)),
        ("duplicate key", _duplicate_key_json(doc, name), None),
        ("deep nesting", b"[" * 100_000 + b"]" * 100_000, None),
        ("not UTF-8", b'{"\xff\xfe": 1}', None),
        ("not JSON", b"{not json", None),
    ]


def _nan_data(streams: WeightsStreams, entry: dict) -> bytes:
    data = bytearray(streams.data)
    begin = entry["data_offsets"][0]
    if entry["dtype"] == "F32":
        data[begin : begin + 4] = struct.pack("<f", math.nan)
    return bytes(data)


def _duplicate_key_json(doc: dict, name: str) -> bytes:
    text = json.dumps(doc)
    extra = json.dumps({name: doc[name]})[1:-1]
    return (text[:-1] + ", " + extra + "}").encode()


def _update_cases(
    streams: WeightsStreams, rng: random.Random, version: Callable[[], int]
) -> Iterator[tuple[str, list[bytes], str]]:
    """(category, messages, note) forever; `version()` is the next valid version number."""
    file = streams.file
    while True:
        good = version()
        pick = rng.randrange(12)
        if pick == 0:  # a valid stream with bit flips in one message
            messages = streams.messages(good)
            index = rng.randrange(len(messages))
            messages[index] = _bit_flips(rng, messages[index])
            yield "update.bitflip", messages, f"message {index}"
        elif pick == 1:  # random message bytes after a valid header, or instead of it
            messages = streams.messages(good)
            junk = [_random_bytes(rng) for _ in range(rng.randint(1, 3))]
            at = rng.randrange(len(messages))
            yield "update.random", messages[:at] + junk, f"junk at {at}"
        elif pick == 2:  # lying safetensors JSON header
            note, document, data = rng.choice(_lying_documents(streams, rng))
            yield (
                "update.lying_header",
                streams.messages(good, file=streams.file_with_header(document, data=data)),
                note,
            )
        elif pick == 3:  # lying length prefix
            size = rng.choice((0, 1, 7, len(streams.json_header) + 3, 2**31, 2**63, UINT64_MAX))
            raw = json.dumps(streams.json_header).encode()
            forged = struct.pack("<Q", size) + raw + streams.data
            yield "update.lying_prefix", streams.messages(good, file=forged), f"prefix {size}"
        elif pick == 4:  # truncated stream: a chunk cut short or missing chunks
            messages = streams.messages(good)
            cut = rng.randrange(1, len(messages))
            kept = messages[:cut]
            if rng.random() < 0.5:
                offset = (cut - 1) * streams.chunk_bytes
                piece = file[offset : offset + rng.randrange(1, streams.chunk_bytes)]
                kept.append(encode_chunk(offset, [piece], crc32(piece)))
            yield "update.truncated", kept, f"cut at message {cut}"
        elif pick == 5:  # chunks after the end, duplicates, out of order, empty
            messages = streams.messages(good)
            how = rng.randrange(4)
            if how == 0:
                messages.append(encode_chunk(len(file), [b"extra"], crc32(b"extra")))
            elif how == 1:
                index = rng.randrange(1, len(messages))
                messages.insert(index, messages[index])
            elif how == 2 and len(messages) > 2:
                messages[1], messages[2] = messages[2], messages[1]
            else:
                messages.insert(rng.randrange(1, len(messages) + 1), encode_chunk(0, []))
            yield "update.order", messages, f"variant {how}"
        elif pick == 6:  # declared sizes far beyond memory
            total = rng.choice((2**40, 2**62, UINT64_MAX, 0, 1, len(file) - 1, len(file) + 1))
            yield (
                "update.sizes",
                streams.messages(good, header=lambda h, t=total: setattr(h, "total_bytes", t)),
                f"total_bytes {total}",
            )
        elif pick == 7:  # versions going backwards (or repeating), zero, the largest
            bad = rng.choice((0, max(good - 1, 0), max(good - 2, 0)))
            yield "update.version", streams.messages(bad), f"version {bad}"
        elif pick == 8:  # header field mutations
            edit = rng.choice(_header_edits())
            yield "update.header_fields", streams.messages(good, header=edit), edit.__name__
        elif pick == 9:  # a second header, a chunk first, an empty stream, header only
            messages = streams.messages(good)
            how = rng.randrange(4)
            variants = [messages[:1] + messages[:1] + messages[1:], messages[1:], [], messages[:1]]
            yield "update.structure", variants[how], f"variant {how}"
        elif pick == 10:  # a bad CRC or a bad SHA-256
            if rng.random() < 0.5:
                messages = streams.messages(good)
                index = rng.randrange(1, len(messages))
                offset = (index - 1) * streams.chunk_bytes
                piece = file[offset : offset + streams.chunk_bytes]
                messages[index] = encode_chunk(offset, [piece], crc32(piece) ^ 1)
                yield "update.checksum", messages, "crc"
            else:
                yield (
                    "update.checksum",
                    streams.messages(good, header=lambda h: setattr(h, "sha256", "0" * 64)),
                    "sha256",
                )
        else:  # chunk framing: unknown fields, repeated fields, varints past 64 bits
            messages = streams.messages(good)
            index = rng.randrange(1, len(messages))
            messages[index] = rng.choice(
                (
                    messages[index] + b"\x20\x01",  # a stray field after the chunk
                    b"\x12\x0b\x08" + b"\xff" * 10,  # an overlong varint offset
                    b"\x12\x03\x08\x01\x08",  # offset twice
                    b"\x22\x00",  # UpdateWeightsRequest field 4
                    b"\x12\x05\x28\x01\x10\x00\x00",  # unknown WeightsChunk field 5
                )
            )
            yield "update.framing", messages, f"message {index}"


def _header_edits() -> list[Callable[[pb.WeightsHeader], None]]:
    def named(name: str, edit: Callable[[pb.WeightsHeader], None]):
        edit.__name__ = name
        return edit

    return [
        named("target critic (none loaded)", lambda h: setattr(h, "target", pb.MODEL_ROLE_CRITIC)),
        named("target reward (none loaded)", lambda h: setattr(h, "target", pb.MODEL_ROLE_REWARD)),
        named("target 99", lambda h: setattr(h, "target", 99)),
        named("mode 77", lambda h: setattr(h, "mode", 77)),
        named("mode lora without lora", lambda h: setattr(h, "mode", pb.UPDATE_MODE_LORA)),
        named("lora in full mode", lambda h: h.lora.CopyFrom(pb.LoraAdapter(rank=4, alpha=8))),
        named(
            "lora rank -1",
            lambda h: (
                setattr(h, "mode", pb.UPDATE_MODE_LORA),
                h.lora.CopyFrom(pb.LoraAdapter(rank=-1, alpha=1)),
            ),
        ),
        named(
            "lora alpha NaN",
            lambda h: (
                setattr(h, "mode", pb.UPDATE_MODE_LORA),
                h.lora.CopyFrom(pb.LoraAdapter(rank=2, alpha=math.nan)),
            ),
        ),
        named("sha256 not hex", lambda h: setattr(h, "sha256", "Z" * 64)),
        named("sha256 huge", lambda h: setattr(h, "sha256", "a" * 1_000_000)),
        named("manifest duplicate", lambda h: h.manifest.append(h.manifest[0])),
        named("manifest wrong shape", lambda h: h.manifest[0].shape.append(7)),
        named("manifest wrong dtype", lambda h: setattr(h.manifest[0], "dtype", pb.DTYPE_INT64)),
        named("manifest unknown dtype", lambda h: setattr(h.manifest[0], "dtype", 55)),
        named(
            "manifest extra", lambda h: h.manifest.add(name="x", dtype=pb.DTYPE_FLOAT32, shape=[1])
        ),
        named(
            "manifest huge shape",
            lambda h: h.manifest.add(
                name="y", dtype=pb.DTYPE_FLOAT32, shape=[INT64_MAX, INT64_MAX]
            ),
        ),
        named("partial mode", lambda h: setattr(h, "mode", pb.UPDATE_MODE_PARTIAL)),  # valid
    ]


# ---- all together -------------------------------------------------------------------------------


def fuzz_cases(
    seed: int,
    count: int,
    *,
    vocab_size: int,
    streams: WeightsStreams,
    next_version: Callable[[], int],
) -> Iterator[Case]:
    """`count` cases, deterministic for a seed, spread over the categories round-robin.

    next_version() is read when an UpdateWeights case is built: the valid version number a
    stream would carry (the server's version + 1), so that only the mutation can make it fail.
    """
    rng = random.Random(seed)
    mutations = _experience_mutations(vocab_size)
    updates = _update_cases(streams, rng, next_version)
    for index in range(count):
        slot = index % 10
        if slot < 2:
            method, kind = rng.choice(_UNARY)
            yield Case("raw.random", method, kind, _random_bytes(rng))
        elif slot < 4:
            method, kind = rng.choice(_UNARY)
            yield Case("raw.bitflip", method, kind, _bit_flips(rng, _valid_unary(method)))
        elif slot < 7:
            request, note = _mutated_experience(rng, mutations)
            yield Case("experience.fields", "MakeExperience", "unary_stream", request, note)
        elif slot == 7 and rng.random() < 0.5:
            subscribe = pb.SubscribeRequest(
                subscriber_id=rng.choice(_BAD_NAMES[:9] + ("ok",)),
                max_batches=rng.choice((-1, -(2**31), 0, 1, INT32_MAX)),
            )
            yield Case(
                "subscribe.fields", "Subscribe", "unary_stream", subscribe.SerializeToString()
            )
        else:
            category, messages, note = next(updates)
            yield Case(category, "UpdateWeights", "stream_unary", tuple(messages), note)
