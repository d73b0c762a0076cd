"""Reference rules shared by the tests of both generation paths (HF forward and the engine)."""

from __future__ import annotations

from rollserve.server.experience.generation import GenerationOutput


def responses(out: GenerationOutput) -> list[list[int]]:
    """Valid response tokens of each row."""
    actions = out.sequences[:, out.prompt_width :]
    return [row[mask].tolist() for row, mask in zip(actions, out.action_mask, strict=True)]


def expected_cut(tokens: list[int], stops, min_new_tokens: int) -> tuple[list[int], bool]:
    """Cut after the earliest complete occurrence ending at index >= min_new_tokens."""
    for end in range(min_new_tokens, len(tokens)):
        for stop in stops:
            start = end + 1 - len(stop)
            if start >= 0 and tuple(tokens[start : end + 1]) == tuple(stop):
                return tokens[: end + 1], True
    return tokens, False
