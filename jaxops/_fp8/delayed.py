"""Delayed scaling: amax histories and scales from them (TransformerEngine's recipe)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import _ffi
from jaxops._fp8.quantize import (
    _check_amax_floor,
    _check_dtype,
    _make_config,
    _quantize_apply,
    _wrap,
)
from jaxops._fp8.scales import AMAX_FLOOR, QuantizedArray, scale_from_amax


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """A delayed-scaling recipe: per-tensor scales from a history of past amaxes.

    Attributes:
      history_len: number of past amax values kept.
      amax_compute: ``"max"`` (largest amax in the history) or ``"most_recent"``.
      margin: the scale is multiplied by ``2**margin`` (headroom for growth).
      dtype: FP8 dtype.
      pow2_scale: round scales up to powers of two.
      amax_floor: lower bound of the amax the scale is computed from.
    """

    history_len: int = 1024
    amax_compute: Literal["max", "most_recent"] = "max"
    margin: int = 0
    dtype: Any = jnp.float8_e4m3fn
    pow2_scale: bool = False
    amax_floor: float = AMAX_FLOOR

    def __post_init__(self):
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(
                f"DelayedScaling: history_len must be an int >= 1, got {self.history_len!r}"
            )
        if self.amax_compute not in ("max", "most_recent"):
            raise ValueError(
                f"DelayedScaling: amax_compute must be 'max' or 'most_recent', "
                f"got {self.amax_compute!r}"
            )
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"DelayedScaling: margin must be an int >= 0, got {self.margin!r}")
        _check_dtype("DelayedScaling", self.dtype)
        _check_amax_floor("DelayedScaling", self.amax_floor)


class Fp8Meta(NamedTuple):
    """Delayed-scaling state of one tensor (a pytree): the amax history and the current scale.

    Attributes:
      amax_history: float32 ``[history_len]``, most recent first.
      scale: float32 ``[]``, the dequantization scale used for the next quantization.
    """

    amax_history: jax.Array
    scale: jax.Array


def init_fp8_meta(recipe: DelayedScaling = DelayedScaling()) -> Fp8Meta:
    """A fresh state: an all-zero history and scale 1.

    Example:
      >>> import jaxops
      >>> meta = jaxops.fp8.init_fp8_meta(jaxops.fp8.DelayedScaling(history_len=4))
      >>> meta.amax_history.shape, float(meta.scale)
      ((4,), 1.0)
    """
    return Fp8Meta(jnp.zeros((recipe.history_len,), jnp.float32), jnp.ones((), jnp.float32))


def scale_from_amax_history(amax_history: jax.Array, recipe: DelayedScaling) -> jax.Array:
    """The scale the recipe derives from a history (float32 ``[]``)."""
    amax = amax_history[0] if recipe.amax_compute == "most_recent" else jnp.max(amax_history)
    amax = amax * np.float32(2.0**recipe.margin)  # exact: a power of two
    return scale_from_amax(
        amax, recipe.dtype, pow2_scale=recipe.pow2_scale, amax_floor=recipe.amax_floor
    )


def update_fp8_meta(meta: Fp8Meta, amax: jax.Array, recipe: DelayedScaling) -> Fp8Meta:
    """Pushes `amax` into the history (dropping the oldest) and recomputes the scale."""
    history = jnp.roll(meta.amax_history, 1).at[0].set(jnp.asarray(amax, jnp.float32))
    return Fp8Meta(history, scale_from_amax_history(history, recipe))


def quantize_delayed(
    x: jax.Array,
    meta: Fp8Meta,
    recipe: DelayedScaling = DelayedScaling(),
    *,
    transpose: bool = False,
    impl: str | None = None,
) -> tuple[QuantizedArray | tuple[QuantizedArray, QuantizedArray], Fp8Meta]:
    """Per-tensor quantization with the scale from `meta`, in one pass over x.

    The kernel measures x's amax while it quantizes; the returned state has it pushed into the
    history and the scale for the next step recomputed (TransformerEngine's delayed scaling).
    Values beyond the stale scale's range saturate.

    Args:
      x: float32, bfloat16 or float16 array, rank >= 1 (>= 2 with `transpose`).
      meta: the tensor's :class:`Fp8Meta`.
      recipe: the :class:`DelayedScaling` recipe.
      transpose: also return the quantized transpose.
      impl: None, ``"ffi"`` or ``"xla"``.

    Returns:
      ``(q, new_meta)``, or ``((q, q_t), new_meta)`` with `transpose`.

    Example:
      >>> import jax.numpy as jnp, jaxops
      >>> recipe = jaxops.fp8.DelayedScaling(history_len=8)
      >>> meta = jaxops.fp8.init_fp8_meta(recipe)
      >>> q, meta = jaxops.fp8.quantize_delayed(jnp.full((4, 32), 3.0), meta, recipe)
      >>> float(meta.amax_history[0])
      3.0
    """
    if not isinstance(meta, Fp8Meta):
        raise TypeError(f"quantize_delayed: meta must be an Fp8Meta, got {type(meta).__name__}")
    x, cfg = _make_config(
        "quantize_delayed",
        x,
        recipe.dtype,
        None,
        recipe.pow2_scale,
        transpose,
        "row",
        recipe.amax_floor,
    )
    scale = jnp.asarray(meta.scale, jnp.float32)
    if scale.shape != ():
        raise ValueError(f"quantize_delayed: meta.scale must have shape (), got {scale.shape}")
    data, scale, data_t, scale_t, amax = _quantize_apply(cfg, x, scale, _ffi.use_kernel(impl))
    return _wrap(cfg, data, scale, data_t, scale_t), update_fp8_meta(meta, amax, recipe)
