"""Experience making: a MakeExperience request in, Experience micro-batches out.

One job per module, in the order a request travels:
  maker.py          ExperienceMaker, NaiveExperienceMaker: the pipeline, and a table of where
                    each Experience field is computed
  steps.py          the steps of one generation batch: generate, score, decode, reward, shape
  generation.py     sampling with a KV cache; rows of a group share their prompt's prefill
  scoring.py        teacher-forced log-probs, entropy, values and reward-model scores, with
                    lm_head applied a chunk of positions at a time
  batches.py        ScoredBatch (a batch between the steps), merging batches, to_experience
  micro_batches.py  cutting rows into micro-batches of whole groups, tight widths

Request decoding (experience_request.py) and reward sources (rewards.py) are still beside this
package in server/. Import from the modules (`from rollserve.server.experience.maker import
NaiveExperienceMaker`): this file imports nothing, because experience_request.py imports
generation.py, and an eager `from .maker import ...` here would close an import cycle.
"""
