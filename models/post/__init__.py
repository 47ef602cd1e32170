"""jaxops.models.post: preference and RL post-training of the decoder.

- Scoring: :class:`Scored` (sequences to score, packed or one per row, each target tagged with
  its sequence), :func:`token_logprobs` and :func:`sequence_logprobs` (over vocabulary chunks
  with the decoder's ``vocab_chunk``: the ``[tokens, V]`` logits never whole).
- DPO: :func:`preference_batch` (chosen / rejected pairs as a Scored batch), :func:`dpo_loss`
  (sigmoid DPO, conservative DPO by label smoothing, IPO; :data:`DPO_LOSSES`),
  :func:`reference_logprobs` and :func:`dpo_step` (a jitted step: with LoRA the reference is
  the same model with its adapters disabled, no second copy of the weights).

- GRPO: :func:`rollout` (G completions per prompt from :func:`~jaxops.models.generate` on the
  parameters being trained, a reward function, :func:`group_advantages`, the sampling policy's
  and the reference's log-probabilities: a :class:`Rollout`), :func:`grpo_loss` (the clipped
  objective with the ratio per token or per sequence, GSPO; :data:`IMPORTANCE_LEVELS`; the
  aggregations of GRPO, DAPO and Dr. GRPO, :data:`GRPO_AGGREGATIONS`; the k3 KL term) and
  :func:`grpo_step`.

Meshes: every mesh the model trains on: data, expert and ZeRO, with gradient accumulation
(``num_microbatches``); pipe (the steps through the pipeline schedule) and context (each
sequence split over devices); rollouts generate on a data x expert mesh. A context axis with
gradient accumulation is refused (not built yet).
"""

if __name__ != "jaxops.models.post":
    raise ImportError(
        f"this is jaxops.models.post and cannot be imported as {__name__!r}; use "
        "`import jaxops.models.post`"
    )

from ._dpo import DPO_LOSSES, PostStep, dpo_loss, dpo_step, preference_batch, reference_logprobs
from ._grpo import (
    GRPO_AGGREGATIONS,
    IMPORTANCE_LEVELS,
    Rollout,
    group_advantages,
    grpo_loss,
    grpo_step,
    rollout,
)
from ._scores import Scored, sequence_logprobs, token_logprobs

__all__ = [
    "DPO_LOSSES",
    "GRPO_AGGREGATIONS",
    "IMPORTANCE_LEVELS",
    "PostStep",
    "Rollout",
    "Scored",
    "dpo_loss",
    "dpo_step",
    "group_advantages",
    "grpo_loss",
    "grpo_step",
    "preference_batch",
    "reference_logprobs",
    "rollout",
    "sequence_logprobs",
    "token_logprobs",
]
