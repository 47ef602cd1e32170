"""Low-rank adapters: :class:`Lora`, the one adapter setting every tier takes.

A weight ``W [in, out]`` with an adapter computes ``x @ W + scaling * (x @ A) @ B`` with
``A [in, r]`` and ``B [r, out]`` (LoRA, Hu et al. 2021; rsLoRA's scaling, Kalajdzievski 2023),
the base weight frozen and only A and B trained. PEFT stores the same factors transposed
(``lora_A.weight [r, in]``, ``lora_B.weight [out, r]``); its ``lora_alpha`` is :attr:`Lora.alpha`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxops._errors import ArgumentTypeError, ConfigError

__all__ = ["Lora", "as_lora", "lora_init"]

_OP = "jaxops.Lora"


@dataclasses.dataclass(frozen=True)
class Lora:
    """Low-rank adapters on chosen weights: ``x @ W + scaling * (x @ A) @ B``.

    Hashable (a jit static argument). The layer or model it is given to names the weights
    it adapts in `targets` (its own parameter names) and refuses a name it does not have,
    listing those it has.

    Attributes:
      rank: r >= 1, the inner width of the adapter.
      alpha: > 0, PEFT's ``lora_alpha``.
      targets: the names of the weights that get adapters (at least one).
      rslora: scale by ``alpha / sqrt(rank)`` (rsLoRA) instead of ``alpha / rank``.
      dropout: the probability, in ``[0, 1)``, of zeroing each element of an adapter's input
        ``x`` in training (PEFT's ``lora_dropout``: ``scaling * (dropout(x) @ A) @ B``, the
        kept elements scaled by ``1 / (1 - dropout)``); the layer or model says which
        adapters take it and where the random key comes from.

    Example:
      >>> from jaxops import Lora
      >>> Lora(rank=8, alpha=16, targets=("w_in",)).scaling
      2.0
      >>> Lora(rank=16, alpha=16, targets=("w_in",), rslora=True).scaling
      4.0
    """

    rank: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False
    dropout: float = 0.0

    def __post_init__(self):
        r = self.rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ConfigError(f"{_OP}: rank must be an int >= 1, got {r!r}")
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a) or a <= 0:
            raise ConfigError(f"{_OP}: alpha must be a finite number > 0, got {a!r}")
        object.__setattr__(self, "alpha", float(a))
        targets = (self.targets,) if isinstance(self.targets, str) else self.targets
        if not isinstance(targets, tuple | list) or not all(isinstance(t, str) for t in targets):
            raise ArgumentTypeError(
                f"{_OP}: targets must be a tuple of weight names, got {self.targets!r}"
            )
        if not targets or len(set(targets)) != len(targets):
            raise ConfigError(f"{_OP}: targets must name distinct weights, got {self.targets!r}")
        object.__setattr__(self, "targets", tuple(targets))
        if not isinstance(self.rslora, bool):
            raise ArgumentTypeError(f"{_OP}: rslora must be a bool, got {self.rslora!r}")
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, int | float) or not 0 <= d < 1:
            raise ConfigError(f"{_OP}: dropout must be a number in [0, 1), got {d!r}")
        object.__setattr__(self, "dropout", float(d))

    @property
    def scaling(self) -> float:
        """``alpha / rank``, or ``alpha / sqrt(rank)`` with rslora."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def check_targets(self, op: str, available: tuple[str, ...]) -> None:
        """Raises ConfigError naming the targets not in `available` (and listing those)."""
        missing = [t for t in self.targets if t not in available]
        if missing:
            raise ConfigError(
                f"{op}: lora targets {missing} match no weight; the weights that can take "
                f"adapters are {list(available)}"
            )


def lora_init(key: jax.Array, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> tuple:
    """float32 ``(A, B)`` as PEFT initializes them: A uniform in ``+-1 / sqrt(in)``, B zeros.

    (PEFT's ``kaiming_uniform_(a=sqrt(5))`` on ``lora_A.weight [r, in]``.) B zero makes a fresh
    adapter add nothing. `a_shape` is ``[..., in, r]``, `b_shape` ``[..., r, out]``.

    Example:
      >>> import jax
      >>> from jaxops._lora import lora_init
      >>> a, b = lora_init(jax.random.key(0), (4, 16, 2), (4, 2, 8))
      >>> a.shape, b.shape, float(abs(a).max()) <= 0.25, float(abs(b).max())
      ((4, 16, 2), (4, 2, 8), True, 0.0)
    """
    bound = 1.0 / math.sqrt(a_shape[-2])
    a = jax.random.uniform(key, a_shape, jnp.float32, -bound, bound)
    return a, jnp.zeros(b_shape, jnp.float32)


def as_lora(op: str, value: Any) -> Lora | None:
    """`value` (None or a Lora) checked."""
    if value is not None and not isinstance(value, Lora):
        raise ArgumentTypeError(f"{op}: lora must be a jaxops.Lora or None, got {value!r}")
    return value
