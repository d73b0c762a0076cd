"""The MakeExperienceRequest of one rollout batch: the --rollout-request template plus prompts.

One batch is one MakeExperienceRequest: the template (protobuf JSON without prompts or
gt_answers; empty: every default) plus the batch's prompts and answers (an empty answer for a
prompt without one when the source has any), a sampling seed derived from the template's seed
(else --rollout-seed) and the step, and request_id "rollout-<step>". Its micro-batches travel as
one SubscribeResponse (micro_batch_size is set to the whole batch). The template is checked at
start-up by decoding the first batch (ContinuousRollout.start), so a bad one fails the start.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import json_format

from ...v1 import rollout_pb2 as pb
from ..experience.request import requested_samples
from .source import PlannedBatch, PromptSource, RolloutSetupError, mix_seed

__all__ = ["build_batch_request", "load_request_template"]


def load_request_template(path: str | Path | None) -> pb.MakeExperienceRequest:
    """The --rollout-request template (protobuf JSON); an empty request when no file is given."""
    template = pb.MakeExperienceRequest()
    if path is None:
        return template
    try:
        json_format.Parse(Path(path).read_text(encoding="utf-8"), template)
    except (OSError, UnicodeDecodeError, json_format.ParseError) as exc:
        raise RolloutSetupError(f"rollout request template {path}: {exc}") from None
    has_prompts = template.token_ids.values or template.token_ids.lengths or template.texts.texts
    if has_prompts or template.gt_answers:
        raise RolloutSetupError(
            f"rollout request template {path}: holds prompts or gt_answers; they come from the "
            "prompt source"
        )
    if template.min_policy_version:
        # The loop stamps each batch with the version it was made by; waiting for a first
        # version is --wait-for-weights' job.
        raise RolloutSetupError(
            f"rollout request template {path}: min_policy_version is not used by the rollout; "
            "start the server with --wait-for-weights instead"
        )
    return template


def build_batch_request(
    template: pb.MakeExperienceRequest, source: PromptSource, planned: PlannedBatch, *, seed: int
) -> pb.MakeExperienceRequest:
    """The template plus one batch's prompts, answers, sampling seed and request id."""
    request = pb.MakeExperienceRequest()
    request.CopyFrom(template)
    prompts = [source.prompts[row] for row in planned.rows]
    if source.is_text:
        request.texts.texts.extend(p.text for p in prompts)  # keeps apply_chat_template
    else:
        request.token_ids.values.extend(t for p in prompts for t in p.token_ids)
        request.token_ids.lengths.extend(len(p.token_ids) for p in prompts)
    if source.has_gt_answers:
        request.gt_answers.extend(p.gt_answer or "" for p in prompts)
    base = template.sampling.seed if template.sampling.HasField("seed") else seed
    request.sampling.seed = mix_seed(base, planned.step)
    # One message per batch: its micro-batches would only be joined again.
    request.batching.micro_batch_size = max(len(prompts) * requested_samples(template), 1)
    request.request_id = f"rollout-{planned.step}"
    return request
