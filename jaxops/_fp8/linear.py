"""The differentiable FP8 layer ``jaxops.fp8.linear``: FP8 GEMMs forward and backward.

Each operand is quantized once together with its transpose (the fused transpose-quantize of
:func:`jaxops.fp8.quantize`); the forward, dgrad and wgrad GEMMs are :func:`fp8_gemm` calls.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxops._checks import renamed_keywords
from jaxops._config import ImplChoice, check_impl
from jaxops._cublaslt import activate, activation_grad, check_dense
from jaxops._errors import InvalidArgumentError
from jaxops._fp8.gemm import BLOCK, fp8_gemm
from jaxops._fp8.quantize import quantize
from jaxops._fp8.recipe import Recipe, as_recipe
from jaxops._fp8.scales import AMAX_FLOOR, GRAD_AMAX_FLOOR
from jaxops._sharding import cotangent_like, unflatten_rows, vary_like

__all__ = ["RECIPES", "fp8_linear"]

#: The scalings ``fp8=`` runs (as names or :class:`~jaxops.fp8.Recipe` s).
RECIPES = ("block", "tensor")


@dataclasses.dataclass(frozen=True)
class _LinearConfig:
    activation: str | None
    fp8: str  # one of RECIPES
    impl: str | None


def _quantize_pair(cfg: _LinearConfig, x, *, weight: bool, grad: bool):
    """(q, q_t): x and its transpose quantized in one pass, as the recipe wants them."""
    if cfg.fp8 == "tensor":
        block = None
        dtype = jnp.float8_e5m2 if grad else jnp.float8_e4m3fn
    else:
        block = (BLOCK, BLOCK) if weight else (1, BLOCK)
        dtype = jnp.float8_e4m3fn
    floor = GRAD_AMAX_FLOOR if grad else AMAX_FLOOR
    return quantize(x, dtype=dtype, block=block, transpose=True, amax_floor=floor, impl=cfg.impl)


def _linear_forward(cfg: _LinearConfig, x, w, bias):
    qx, qx_t = _quantize_pair(cfg, x, weight=False, grad=False)
    qw, qw_t = _quantize_pair(cfg, w, weight=True, grad=False)
    # Forward: x [M, K] @ w [K, N]; b = w as data [N, K] (the transposed copy).
    h = fp8_gemm(qx, qw_t, bias=bias, activation=None, out_dtype=jnp.float32, impl=cfg.impl)
    y = activate(cfg.activation, h)
    return y.astype(x.dtype), (qx_t, qw, h.astype(x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _linear(cfg: _LinearConfig, x, w, bias):
    return _linear_forward(cfg, x, w, bias)[0]


def _linear_fwd(cfg: _LinearConfig, x, w, bias):
    y, (qx_t, qw, h) = _linear_forward(cfg, x, w, bias)
    # Empty arrays that carry the shard_map varying axes of x and w, for the cotangents.
    markers = tuple(vary_like(jnp.zeros((0,), jnp.float32), v) for v in (x, w))
    return y, (qx_t, qw, h, bias, markers)


def _linear_bwd(cfg: _LinearConfig, saved, dy):
    qx_t, qw, h, bias, (x_marker, w_marker) = saved
    dh = (dy.astype(jnp.float32) * activation_grad(cfg.activation, h.astype(jnp.float32))).astype(
        dy.dtype
    )
    qd, qd_t = _quantize_pair(cfg, dh, weight=False, grad=True)
    # dgrad: dx [M, K] = dh [M, N] @ w^T. b = w^T, logical [N, K]: qw's data [K, N] read as the
    # transposed copy (valid for tiles and per-tensor scales, the weight's two recipes).
    dx = fp8_gemm(
        qd, dataclasses.replace(qw, transposed=True), out_dtype=jnp.float32, impl=cfg.impl
    )
    # wgrad: dw [K, N] = x^T [K, M] @ dh [M, N]. a = x^T: qx_t's data [K, M] (groups along M)
    # read as a plain array; b = dh from its transposed copy qd_t (data [N, M], groups along M).
    a_t = dataclasses.replace(qx_t, transposed=False)
    dw = fp8_gemm(a_t, qd_t, out_dtype=jnp.float32, impl=cfg.impl)
    db = None if bias is None else jnp.sum(dh.astype(jnp.float32), axis=0).astype(bias.dtype)
    return (
        cotangent_like(dx.astype(dy.dtype), x_marker),
        cotangent_like(dw.astype(dy.dtype), w_marker),
        cotangent_like(db, bias),
    )


_linear.defvjp(_linear_fwd, _linear_bwd)


@renamed_keywords("jaxops.fp8.linear", {"recipe": "fp8"})
def fp8_linear(
    x: jax.Array,
    w: jax.Array,
    bias: jax.Array | None = None,
    *,
    activation: str | None = None,
    fp8: Recipe | str = "block",
    impl: ImplChoice = None,
) -> jax.Array:
    """A differentiable FP8 dense layer: ``act(x @ w + bias)`` with FP8 GEMMs forward and backward.

    fp8="block" (DeepSeek-V3): x and the output gradient in 1 x 128 groups, w in 128 x 128
    tiles, all float8_e4m3fn. fp8="tensor": per-tensor current scaling, e4m3 forward and e5m2
    gradients. Each tensor is quantized once together with its transpose (the fused
    transpose-quantize of ``jaxops.fp8.quantize``): the forward uses x and wᵀ's copy, dgrad the
    output gradient and w, wgrad xᵀ and the gradient's transpose. Accumulation is fp32; the
    bias and activation are applied in fp32.

    Args:
      x: float32, bfloat16 or float16 ``[..., K]``.
      w: x's dtype ``[K, N]``.
      bias: None or ``[N]``.
      activation: None, "relu", "gelu", "gelu_tanh" or "silu".
      fp8: the :class:`~jaxops.fp8.Recipe` (or its name), block or tensor scaling; a delayed
        recipe is refused (its scales are state: ``quantize_delayed``). The keyword ``recipe=``
        is its deprecated name.
      impl: jaxops' implementation policy (:func:`jaxops.choose_impl`) of the quantization and
        the GEMMs.

    Returns:
      ``[..., N]`` in x's dtype.

    Raises:
      TypeError / ValueError: bad dtypes or shapes, unknown recipe or activation.

    Example:
      >>> import jax, jax.numpy as jnp, jaxops
      >>> x = jax.random.normal(jax.random.key(0), (128, 256), jnp.bfloat16)
      >>> w = jax.random.normal(jax.random.key(1), (256, 128), jnp.bfloat16) / 16
      >>> loss = lambda x, w: jaxops.fp8.linear(x, w, activation="gelu").astype(jnp.float32).sum()
      >>> [g.shape for g in jax.grad(loss, argnums=(0, 1))(x, w)]
      [(128, 256), (256, 128)]
    """
    op = "jaxops.fp8.linear"
    x, w, bias, activation, _, _ = check_dense(op, x, w, bias, activation, False)
    recipe = as_recipe(fp8, op, allowed=RECIPES)
    if recipe is None:
        raise InvalidArgumentError(f"{op}: fp8 must be a recipe (block or tensor), got None")
    check_impl(op, impl)
    cfg = _LinearConfig(activation, recipe.scaling, impl)
    k = x.shape[-1]
    y = _linear(cfg, x.reshape(-1, k), w, bias)
    return unflatten_rows(y, x)
