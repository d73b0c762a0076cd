"""Continuous rollout: the server reads a prompt source, keeps making experience while trainers
are subscribed, and deals each batch to exactly one of them (ColossalChat's
ExperienceMakerHolder over gRPC, without Ray). The Subscribe RPC and Health.rollout expose it.

One job per module, in the order a batch travels:
  source.py         the JSONL prompt source and the schedule of batches (epochs, steps, seeds)
  batch_request.py  the --rollout-request template plus one batch's prompts -> a request
  loop.py           ContinuousRollout: the thread that makes one batch at a time on the engine
  dealer.py         the bounded queue (back-pressure), round-robin dealing, credit windows,
                    staleness drops at hand-over, and a Subscription: one subscriber's place
                    in the ring
  subscribe.py      one Subscribe call: check it, join the ring, yield the dealt batches, read
                    the acknowledgements
"""

from .batch_request import build_batch_request, load_request_template
from .dealer import MAX_WINDOW, Dealer, MadeBatch, Subscription
from .loop import ContinuousRollout, RolloutSettings, RolloutStats
from .source import (
    PlannedBatch,
    PromptSource,
    RolloutSetupError,
    SourcePrompt,
    load_prompt_source,
    plan_batches,
)
from .subscribe import serve_subscribe

__all__ = [
    "MAX_WINDOW",
    "ContinuousRollout",
    "Dealer",
    "MadeBatch",
    "PlannedBatch",
    "PromptSource",
    "RolloutSettings",
    "RolloutSetupError",
    "RolloutStats",
    "SourcePrompt",
    "Subscription",
    "build_batch_request",
    "load_prompt_source",
    "load_request_template",
    "plan_batches",
    "serve_subscribe",
]
