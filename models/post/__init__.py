"""jaxops.models.post: preference and RL post-training of the decoder.

- Scoring: :class:`Scored` (sequences to score, packed or one per row, each target tagged with
  its sequence), :func:`token_logprobs` and :func:`sequence_logprobs` (over vocabulary chunks
  with the decoder's ``vocab_chunk``: the ``[tokens, V]`` logits never whole).
- DPO: :func:`preference_batch` (chosen / rejected pairs as a Scored batch), :func:`dpo_loss`
  (sigmoid DPO, conservative DPO by label smoothing, IPO; :data:`DPO_LOSSES`),
  :func:`reference_logprobs` and :func:`dpo_step` (a jitted step: with LoRA the reference is
  the same model with its adapters disabled, no second copy of the weights).

Meshes: data, expert and ZeRO; a pipe or context axis, and gradient accumulation, are refused
(not built yet).
"""

if __name__ != "jaxops.models.post":
    raise ImportError(
        f"this is jaxops.models.post and cannot be imported as {__name__!r}; use "
        "`import jaxops.models.post`"
    )

from ._dpo import DPO_LOSSES, PostStep, dpo_loss, dpo_step, preference_batch, reference_logprobs
from ._scores import Scored, sequence_logprobs, token_logprobs

__all__ = [
    "DPO_LOSSES",
    "PostStep",
    "Scored",
    "dpo_loss",
    "dpo_step",
    "preference_batch",
    "reference_logprobs",
    "sequence_logprobs",
    "token_logprobs",
]
