"""The FP8 recipe: one value that says how a computation uses FP8, accepted by every tier.

A :class:`Recipe` is what ``fp8=`` takes everywhere (``jaxops.fp8.linear``, the delayed-scaling
functions, ``MoEConfig``, ``MoEDecoder``, ``jaxops.models.plan``, ``save_pretrained``'s
``quantize=``), from the user's hand to the kernel unchanged:

- ``"tensor"``: per-tensor current scaling, e4m3 forward and e5m2 gradients;
- ``"delayed"``: per-tensor scales from an amax history (TransformerEngine's recipe; its
  settings a :class:`~jaxops.fp8.DelayedScaling`);
- ``"block"``: DeepSeek-V3's block scaling, activations and gradients in 1 x 128 groups,
  weights in 128 x 128 tiles, all e4m3 (the layout published FP8 checkpoints store).

The names ``"tensor"`` and ``"block"`` and a ``DelayedScaling`` stand for their recipes wherever
a recipe is taken (:func:`as_recipe`), and a recipe compares equal to its name, so code written
for the names keeps working. Each consumer says which recipes it runs and refuses the others by
name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxops._errors import ArgumentTypeError, InvalidArgumentError
from jaxops._fp8.delayed import DelayedScaling

__all__ = ["BLOCK", "SCALINGS", "TENSOR", "Recipe", "as_recipe"]

#: The scalings a :class:`Recipe` names.
SCALINGS = ("tensor", "delayed", "block")


@dataclasses.dataclass(frozen=True, eq=False)
class Recipe:
    """An FP8 recipe: the scaling, and for "delayed" its history settings.

    Attributes:
      scaling: "tensor", "delayed" or "block" (:data:`SCALINGS`).
      delayed: the :class:`~jaxops.fp8.DelayedScaling` of a "delayed" recipe (default settings
        when not given); None for the others.

    Example:
      >>> from jaxops import fp8
      >>> fp8.BLOCK == "block", fp8.Recipe("block") == fp8.BLOCK
      (True, True)
      >>> fp8.BLOCK.block_shapes
      ((1, 128), (128, 128))
      >>> fp8.as_recipe(fp8.DelayedScaling(history_len=16)).scaling
      'delayed'
    """

    scaling: str
    delayed: DelayedScaling | None = None

    def __post_init__(self):
        op = "jaxops.fp8.Recipe"
        if self.scaling not in SCALINGS:
            raise InvalidArgumentError(
                f"{op}: scaling must be one of {SCALINGS}, got {self.scaling!r}"
            )
        if self.scaling == "delayed":
            if self.delayed is None:
                object.__setattr__(self, "delayed", DelayedScaling())
            elif not isinstance(self.delayed, DelayedScaling):
                raise ArgumentTypeError(
                    f"{op}: delayed must be a jaxops.fp8.DelayedScaling, got "
                    f"{type(self.delayed).__name__}"
                )
        elif self.delayed is not None:
            raise InvalidArgumentError(
                f"{op}: delayed settings belong to the 'delayed' scaling, not {self.scaling!r}"
            )

    @property
    def block_shapes(self) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """``(activation block, weight block)`` of the "block" recipe; None for the others."""
        return ((1, 128), (128, 128)) if self.scaling == "block" else None

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, str):  # the name stands for its recipe
            return self.scaling == other and self.scaling != "delayed"
        if isinstance(other, Recipe):
            return (self.scaling, self.delayed) == (other.scaling, other.delayed)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.scaling)

    def __repr__(self) -> str:
        if self.scaling == "delayed":
            return f"Recipe('delayed', {self.delayed!r})"
        return f"Recipe({self.scaling!r})"


#: Block scaling (DeepSeek-V3): 1 x 128 activation groups, 128 x 128 weight tiles, e4m3.
BLOCK = Recipe("block")
#: Per-tensor current scaling: e4m3 forward, e5m2 gradients.
TENSOR = Recipe("tensor")


def as_recipe(
    fp8: Any,
    op: str = "jaxops.fp8.as_recipe",
    allowed: tuple[str, ...] = SCALINGS,
    name: str = "fp8",
) -> Recipe | None:
    """The :class:`Recipe` an ``fp8=`` argument names, or None for None.

    Args:
      fp8: None, a :class:`Recipe`, ``"tensor"``, ``"block"`` or a
        :class:`~jaxops.fp8.DelayedScaling` (the "delayed" recipe with those settings).
      op: the public name of the call, which starts the error messages.
      allowed: the scalings the caller runs; the others are refused by name.
      name: the caller's name of the argument, for the messages.

    Raises:
      InvalidArgumentError: an unknown recipe, or one the caller does not run.

    Example:
      >>> from jaxops import fp8
      >>> fp8.as_recipe("block") is fp8.BLOCK, fp8.as_recipe(None)
      (True, None)
    """
    if fp8 is None:
        return None
    if isinstance(fp8, Recipe):
        recipe = fp8
    elif isinstance(fp8, DelayedScaling):
        recipe = Recipe("delayed", fp8)
    elif isinstance(fp8, str) and fp8 in ("tensor", "block"):
        recipe = TENSOR if fp8 == "tensor" else BLOCK
    else:
        raise InvalidArgumentError(
            f"{op}: {name} must be None, a jaxops.fp8.Recipe, 'tensor', 'block' or a "
            f"jaxops.fp8.DelayedScaling, got {fp8!r}"
        )
    if recipe.scaling not in allowed:
        raise InvalidArgumentError(
            f"{op}: {name}={recipe!r} is not a recipe this call runs; it takes "
            f"{' or '.join(repr(s) for s in allowed)} scaling"
        )
    return recipe
