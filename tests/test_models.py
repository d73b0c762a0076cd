"""Loading: the served weights live in the server's own memory, not in the checkpoint file."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from rollserve.server.config import ServerConfig
from rollserve.server.models import load_models


def test_rewriting_the_checkpoint_in_place_leaves_the_served_weights_alone(
    tiny_actor_dir: Path, tmp_path: Path
) -> None:
    # A trainer that saves into the directory the server loaded from rewrites the same inode.
    directory = tmp_path / "actor"
    shutil.copytree(tiny_actor_dir, directory)
    models = load_models(ServerConfig(device="cpu", actor=str(directory)))
    before = {k: v.clone() for k, v in models.actor.module.state_dict().items()}
    checkpoint = directory / "model.safetensors"
    size = checkpoint.stat().st_size
    with checkpoint.open("r+b") as file:  # in place: header kept, every weight byte becomes 0x7f
        header_end = 8 + int.from_bytes(file.read(8), "little")
        file.seek(header_end)
        file.write(b"\x7f" * (size - header_end))
    after = models.actor.module.state_dict()
    changed = [k for k, v in before.items() if not torch.equal(v, after[k])]
    assert changed == [], f"the served weights followed the file: {changed[:3]}"
