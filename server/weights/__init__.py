"""Weight updates: safetensors stream staging, verification, atomic swap, LoRA merge."""
