"""Delayed scaling: amax histories and scales from them (TransformerEngine's recipe).

The recipe (a :class:`DelayedScaling`, or the "delayed" :class:`jaxops.fp8.Recipe` that holds one)
is the ``fp8`` argument of every function here; its old keyword ``recipe=`` still works for one
release, with a DeprecationWarning.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import _ffi
from jaxops._checks import renamed_keywords
from jaxops._config import check_impl
from jaxops._errors import ArgumentTypeError, ConfigError, InvalidArgumentError
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
        op = "jaxops.fp8.DelayedScaling"
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ConfigError(f"{op}: history_len must be an int >= 1, got {self.history_len!r}")
        if self.amax_compute not in ("max", "most_recent"):
            raise ConfigError(
                f"{op}: amax_compute must be 'max' or 'most_recent', got {self.amax_compute!r}"
            )
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ConfigError(f"{op}: margin must be an int >= 0, got {self.margin!r}")
        _check_dtype(op, self.dtype)
        _check_amax_floor(op, self.amax_floor)


class Fp8Meta(NamedTuple):
    """Delayed-scaling state of one tensor (a pytree): the amax history and the current scale.

    Attributes:
      amax_history: float32 ``[history_len]``, most recent first.
      scale: float32 ``[]``, the dequantization scale used for the next quantization.
    """

    amax_history: jax.Array
    scale: jax.Array


_RENAMED = {"recipe": "fp8"}


def _settings(op: str, fp8: Any) -> DelayedScaling:
    """The DelayedScaling of `fp8`: itself, or a "delayed" :class:`jaxops.fp8.Recipe`'s."""
    if isinstance(fp8, DelayedScaling):
        return fp8
    if getattr(fp8, "scaling", None) == "delayed":  # a Recipe (jaxops._fp8.recipe imports us)
        return fp8.delayed
    raise ArgumentTypeError(
        f"{op}: fp8 must be a jaxops.fp8.DelayedScaling or a 'delayed' jaxops.fp8.Recipe, "
        f"got {fp8!r}"
    )


@renamed_keywords("jaxops.fp8.init_fp8_meta", _RENAMED)
def init_fp8_meta(fp8: DelayedScaling = DelayedScaling()) -> Fp8Meta:
    """A fresh state: an all-zero history and scale 1.

    Example:
      >>> import jaxops
      >>> meta = jaxops.fp8.init_fp8_meta(jaxops.fp8.DelayedScaling(history_len=4))
      >>> meta.amax_history.shape, float(meta.scale)
      ((4,), 1.0)
    """
    fp8 = _settings("jaxops.fp8.init_fp8_meta", fp8)
    return Fp8Meta(jnp.zeros((fp8.history_len,), jnp.float32), jnp.ones((), jnp.float32))


@renamed_keywords("jaxops.fp8.scale_from_amax_history", _RENAMED)
def scale_from_amax_history(amax_history: jax.Array, fp8: DelayedScaling) -> jax.Array:
    """The scale the recipe `fp8` derives from a history (float32 ``[]``)."""
    fp8 = _settings("jaxops.fp8.scale_from_amax_history", fp8)
    amax = amax_history[0] if fp8.amax_compute == "most_recent" else jnp.max(amax_history)
    amax = amax * np.float32(2.0**fp8.margin)  # exact: a power of two
    return scale_from_amax(amax, fp8.dtype, pow2_scale=fp8.pow2_scale, amax_floor=fp8.amax_floor)


@renamed_keywords("jaxops.fp8.update_fp8_meta", _RENAMED)
def update_fp8_meta(meta: Fp8Meta, amax: jax.Array, fp8: DelayedScaling) -> Fp8Meta:
    """Pushes `amax` into the history (dropping the oldest) and recomputes the scale."""
    history = jnp.roll(meta.amax_history, 1).at[0].set(jnp.asarray(amax, jnp.float32))
    fp8 = _settings("jaxops.fp8.update_fp8_meta", fp8)
    return Fp8Meta(history, scale_from_amax_history(history, fp8))


@renamed_keywords("jaxops.fp8.quantize_delayed", _RENAMED)
def quantize_delayed(
    x: jax.Array,
    meta: Fp8Meta,
    fp8: DelayedScaling = DelayedScaling(),
    *,
    transpose: bool = False,
    impl: str | None = None,
) -> tuple[QuantizedArray | tuple[QuantizedArray, QuantizedArray], Fp8Meta]:
    """Per-tensor quantization with the scale from `meta`, in one pass over x.

    The kernel measures x's amax while it quantizes; the returned state has it pushed into the
    history and the scale for the next step recomputed (TransformerEngine's delayed scaling).
    Values beyond the stale scale's range saturate. A positive scale below float32's smallest
    normal number (only a hand-set ``meta.scale`` can be one) is raised to it: XLA:CPU flushes
    subnormal operands to zero, which would make every code NaN there.

    Args:
      x: float32, bfloat16 or float16 array, rank >= 1 (>= 2 with `transpose`).
      meta: the tensor's :class:`Fp8Meta`.
      fp8: the :class:`DelayedScaling` (or a "delayed" ``jaxops.fp8.Recipe``; the keyword
        ``recipe=`` is its deprecated name).
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
    op = "jaxops.fp8.quantize_delayed"
    fp8 = _settings(op, fp8)
    if not isinstance(meta, Fp8Meta):
        raise ArgumentTypeError(f"{op}: meta must be an Fp8Meta, got {type(meta).__name__}")
    x, cfg = _make_config(op, x, fp8.dtype, None, fp8.pow2_scale, transpose, "row", fp8.amax_floor)
    scale = jnp.asarray(meta.scale, jnp.float32)
    if scale.shape != ():
        raise InvalidArgumentError(f"{op}: meta.scale must have shape (), got {scale.shape}")
    # Compared as bits: XLA:CPU would also flush the comparison's operand.
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
    subnormal = (bits > 0) & (bits < np.uint32(0x00800000))
    scale = jnp.where(subnormal, np.float32(np.finfo(np.float32).tiny), scale)
    use_kernel = _ffi.use_kernel(check_impl(op, impl), op)
    data, scale, data_t, scale_t, amax = _quantize_apply(cfg, x, scale, use_kernel)
    return _wrap(cfg, data, scale, data_t, scale_t), update_fp8_meta(meta, amax, fp8)
