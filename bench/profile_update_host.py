"""The host side of one big update into a pipelined ("device") arena on the CPU, per data plane.

What the server does per update that does not scale with bytes (Python per ring slot, per
tensor, per lane) shows up here without a GPU: a model shaped like the GPU bench's (Qwen2-0.5B
with an untied lm_head by default: ~290 tensors, 1.26 GB bfloat16) is staged in-process through
the same code a CUDA server runs (a StagingArena on the "cpu" device: the ring, the routing,
the per-tensor checks), then applied, and the per-phase timings the server logs
(weights/timings.py) are printed for each plane:

* grpc: the stager fed 1 MiB chunks in order (one lane, as one stream);
* tensor, cuda_ipc's feed_tensor path: the head as chunks, then the data section as one tensor
  (as the plane feeds a device arena);
* in_place, cuda_ipc's path for a flat buffer on the model's device: the data section offered
  before the head and placed after it (stream.py): no arena, checks and apply read it;
  in_place_kept the same with the staged views kept with the memory (a kept CUDA IPC buffer);
* shm: receive_shared_memory from a sealed memfd of this process, with --lanes threads.

    python bench/profile_update_host.py                 # the full size (~5 GB of host memory)
    python bench/profile_update_host.py --layers 2      # a quick look
    python bench/profile_update_host.py --profile shm   # plus cProfile of that plane's update
    python bench/profile_update_host.py --layout per-tensor  # the model's weights not in one buffer
"""

from __future__ import annotations

import argparse
import cProfile
import fcntl
import mmap
import os
import pstats
import sys

import torch
from rollserve.client.protocol.shared_memory import REQUIRED_SEALS
from rollserve.client.weights.update_file import iter_safetensors_bytes, prepare_update
from rollserve.server.models.memory import own_memory
from rollserve.server.weights import verify
from rollserve.server.weights.arena import StagingArena, set_staging_arena
from rollserve.server.weights.lora import LoraState
from rollserve.server.weights.pipeline import RING_SLOTS, SLOT_BYTES, SlotRing
from rollserve.server.weights.shared_memory import receive_shared_memory
from rollserve.server.weights.staging import UpdateStager
from rollserve.server.weights.timings import UpdateTimings
from rollserve.v1 import rollout_pb2 as pb

CHUNK_BYTES = 1 << 20


class Shaped(torch.nn.Module):
    """Parameters named and shaped like a Qwen2 decoder (values: small, finite)."""

    def __init__(self, layers: int, hidden: int, inner: int, vocab: int, kv: int) -> None:
        super().__init__()
        shapes = {"model.embed_tokens.weight": (vocab, hidden)}
        for i in range(layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.q_proj.bias": (hidden,),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (inner, hidden),
                p + "mlp.up_proj.weight": (inner, hidden),
                p + "mlp.down_proj.weight": (hidden, inner),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
        # Nested modules named like the decoder's, so that the state dict (and apply's lookup
        # of the live tensors, spec.live_tensors) walks a tree as deep as a real model's.
        for name, shape in shapes.items():
            *path, attr = name.split(".")
            module: torch.nn.Module = self
            for part in path:
                child = module._modules.get(part)
                if child is None:
                    child = torch.nn.Module()
                    module.add_module(part, child)
                module = child
            parameter = torch.nn.Parameter(torch.full(shape, 0.5, dtype=torch.bfloat16))
            module.register_parameter(attr, parameter)


def header_and_file(
    weights: dict[str, torch.Tensor], version: int
) -> tuple[pb.WeightsHeader, bytes]:
    update = prepare_update(weights, version=version)
    return update.header, b"".join(
        bytes(piece) for piece in iter_safetensors_bytes(weights, 64 << 20)
    )


def sealed_memfd(data: bytes) -> int:
    fd = os.memfd_create("rollserve-profile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, len(data))
    with mmap.mmap(fd, len(data)) as mapping:
        mapping[:] = data
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
    return fd


_KEPT_VIEWS: dict = {}  # plane in_place_kept's views, kept across its updates


def run(plane: str, model: torch.nn.Module, header: pb.WeightsHeader, file: bytes,
        arena: StagingArena, lanes: int, fd: int, data: torch.Tensor) -> UpdateTimings:  # fmt: skip
    timings = UpdateTimings()
    with arena.lease():
        stager = UpdateStager(header, model, LoraState(), arena=arena, timings=timings)
        view = memoryview(file)
        head = 8 + int.from_bytes(file[:8], "little")
        if plane.startswith("in_place"):  # cuda_ipc's flat buffer: offered, then placed
            # in_place_kept: the views remembered with the memory across updates, as a kept
            # CUDA IPC buffer has them (cuda_ipc.py); in_place: made every update.
            views = _KEPT_VIEWS if plane == "in_place_kept" else None
            stager.offer_in_place(data.device, head, views)
        if plane == "grpc":
            for offset in range(0, len(file), CHUNK_BYTES):
                stager.feed(offset, view[offset : offset + CHUNK_BYTES])
        elif plane == "tensor":
            stager.feed(0, view[:head])
            stager.feed_tensor(head, data[head:])  # a device arena takes the span whole
        elif plane.startswith("in_place"):
            lane = stager.lane(0, len(file))
            lane.feed(0, view[:head])
            assert lane.file_data.in_place, "the head did not allow staging in place"
            lane.place(data[head:])
        else:
            source = pb.SharedMemorySource(pid=os.getpid(), fd=fd)
            receive_shared_memory(stager, source, iter(()), lanes=lanes)
        timings.lap("receive")
        staged = stager.finish()
        timings.lap("finish")
        staged.apply(model)
        timings.lap("apply")
    return timings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument(
        "--shape", default="896,4864,151936,128", help="hidden,intermediate,vocab,kv width"
    )
    parser.add_argument("--planes", default="grpc,tensor,in_place,in_place_kept,shm")
    parser.add_argument("--lanes", type=int, default=4, help="shm copy lanes (threads)")
    parser.add_argument("--slots", type=int, default=RING_SLOTS, help="ring slots")
    parser.add_argument("--slot-mib", type=int, default=SLOT_BYTES >> 20, help="ring slot size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--group-bytes", type=int, default=None, help="verify.GROUP_BYTES (0: one check per tensor)"
    )
    parser.add_argument("--profile", default="", help="a plane to run under cProfile once")
    parser.add_argument(
        "--layout",
        choices=("flat", "per-tensor"),
        default="flat",
        help="the model's weights in one buffer in the file's order, as a server loads them "
        "(models/memory.py; its apply is one copy per run), or an allocation each",
    )
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.group_bytes is not None:
        verify.GROUP_BYTES = args.group_bytes
    model = Shaped(args.layers, *(int(n) for n in args.shape.split(",")))
    if args.layout == "flat":
        own_memory(model)
    weights = {name: torch.full_like(t, 0.25) for name, t in model.state_dict().items()}
    ring = SlotRing(pin_memory=False, slots=args.slots, slot_bytes=args.slot_mib << 20)
    arena = StagingArena(device="cpu", ring=ring)
    set_staging_arena(model, arena)
    header, file = header_and_file(weights, 1)
    fd = sealed_memfd(file)
    data = torch.frombuffer(bytearray(file), dtype=torch.uint8)  # a trainer's tensor bytes
    print(f"{len(weights)} tensors, {len(file) / 1e9:.2f} GB, ring "
          f"{arena.ring._limit} x {arena.ring.slot_bytes >> 20} MiB")  # fmt: skip
    version = 1
    for plane in args.planes.split(","):
        best: UpdateTimings | None = None
        for _ in range(args.rounds + 1):
            version += 1
            header.version = version
            timings = run(plane, model, header, file, arena, args.lanes, fd, data)
            if best is None or timings.total_s < best.total_s:
                best = timings
        assert best is not None
        print(f"{plane}: {len(file) / best.total_s / 1e9:.2f} GB/s; {best.line()}", flush=True)
        if plane == args.profile:
            version += 1
            header.version = version
            profiler = cProfile.Profile()
            profiler.runcall(run, plane, model, header, file, arena, args.lanes, fd, data)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
