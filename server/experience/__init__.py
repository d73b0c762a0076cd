"""Experience making: a MakeExperience request in, Experience micro-batches out.

One job per module, in the order a request travels:
  request.py        decoding a MakeExperienceRequest: every field read, defaulted and checked
                    once, against the server's defaults and limits (RequestDefaults)
  maker.py          NaiveExperienceMaker: the pipeline, the min_policy_version gate, and a
                    table of where each Experience field is computed
  steps.py          the steps of one generation batch: generate, score, decode, reward, shape
  generation.py     sampling with a KV cache; rows of a group share their prompt's prefill
  scoring.py        teacher-forced log-probs, entropy, values and reward-model scores, with
                    lm_head applied a chunk of positions at a time
  rewards.py        the text reward sources: built-in rules, user functions, HTTP endpoints
  batches.py        ScoredBatch (a batch between the steps), merging batches, to_experience
  micro_batches.py  cutting rows into micro-batches of whole groups, tight widths

Import from the modules (`from rollserve.server.experience.maker import NaiveExperienceMaker`):
this file imports nothing, so that importing one step (generation.py, say) does not load the
whole pipeline.
"""
