"""GEMM with fused bias and activation epilogues: :func:`jaxops.gemm` and its twin.

Where it runs:

- **CUDA** (jaxops built with cuBLASLt): the ``jaxops_gemm`` custom call (:mod:`jaxops._cublaslt`).
  cuBLASLt fuses bias, relu and gelu_tanh (its GELU is the tanh approximation) into the GEMM and
  writes the pre-activation as the epilogue's auxiliary output when a backward needs it. exact
  "gelu" and "silu" have no cuBLASLt epilogue: the GEMM fuses the bias and XLA applies the
  activation in one elementwise pass. The backward runs dgrad and wgrad as custom calls too, the
  wgrad with the bias-gradient epilogue (BGRADA) fused; the activation derivative is one XLA
  elementwise pass over the saved pre-activation. (cuBLASLt's DGELU epilogue applies to the output
  of the *next* layer's dgrad GEMM, which a single op does not own.)
- **CPU**: XLA's own dot is the best CPU GEMM here, so the CPU path is the pure-JAX composition
  (the twin), documented as such; the CUDA path is tested against it. Its weight gradient
  multiplies a transposed copy of the rows, so that XLA:CPU runs it as a plain GEMM
  (:func:`_weight_grad`).

The FP8 GEMM and the FP8 layer (``jaxops.fp8.gemm``, ``jaxops.fp8.linear``) live in
:mod:`jaxops._fp8` and share the cuBLASLt layer.

Layers of the CUDA path: :func:`gemm` → ``jax.custom_vjp`` → ``custom_vmap`` (a vmap over x
alone folds into the rows) → ``custom_partitioning`` with a Shardy rule (rows of x and columns of
w stay local; a sharded contraction axis is refused with a clear error instead of being gathered)
→ ``jax.ffi.ffi_call``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning

from jaxops import _checks
from jaxops._config import resolve_impl
from jaxops._cublaslt import (
    ACTIVATIONS,
    TARGET_GEMM,
    activate,
    activation_grad,
    check_dense,
    gemm_call,
    kernel_available,
)
from jaxops._errors import InvalidArgumentError
from jaxops._precision import MODES, current_precision, dot_precision
from jaxops._sharding import cotangent_like, padded_spec, unflatten_rows

__all__ = ["ACTIVATIONS", "TARGET_GEMM", "gemm", "gemm_reference"]


# -------------------------------------------------------------------------------------------------
# Configuration.


@dataclasses.dataclass(frozen=True)
class _Config:
    activation: str | None
    transpose_w: bool
    mode: str  # precision mode, resolved at trace time
    kernel: bool  # cuBLASLt custom calls (else the pure-JAX composition)


def _explicit_sharding(x) -> Any:
    """`x`'s sharding when it lives on a mesh with Explicit axes (sharding in types), else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", ()) or ()
    if not any(t == jax.sharding.AxisType.Explicit for t in types):
        return None
    return sharding


def _wgrad_sharding(w, *operands) -> Any:
    """The sharding of a weight gradient on an Explicit mesh (None elsewhere).

    It contracts over the rows, which may be sharded; jax then needs the output sharding
    spelled out: the weight's own, or replicated when only the operands are on the mesh.
    """
    own = _explicit_sharding(w)
    if own is not None:
        return own
    for x in operands:
        s = _explicit_sharding(x)
        if s is not None:
            return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())
    return None


def _matmul_reference(
    mode: str, a, b, transpose_a: bool, transpose_b: bool, like=None
) -> jax.Array:
    """op(a) @ op(b) in float32 (fp32 accumulation), XLA's dot with the mode's precision.

    `like`: for a weight gradient, the weight (whose sharding the result takes on an Explicit
    mesh).
    """
    dims = (((0 if transpose_a else 1),), ((1 if transpose_b else 0),))
    out = None if like is None else _wgrad_sharding(like, a, b)
    return jax.lax.dot_general(
        a,
        b,
        (dims, ((), ())),
        precision=dot_precision(mode, a.dtype),
        preferred_element_type=jnp.float32,
        **({} if out is None else {"out_sharding": out}),
    )


def _weight_grad(mode: str, a, b, like) -> jax.Array:
    """``a.T @ b`` in float32 (the twin's weight gradient, contracting the rows of a and b).

    On XLA:CPU a dot that contracts its LHS's rows is not one of XNNPACK's (YNNPACK's) GEMMs
    and goes to Eigen's contraction, which allocates and packs its blocks on every call; a
    transposed copy of a, which the ``optimization_barrier`` keeps XLA from folding back into
    the dot, makes it a plain ``[K, M] @ [M, N]`` that YNNPACK runs. Measured on one core of a
    2-core AMD EPYC (AVX2), K = 256 and M = 256 rows: 1.1-2.2x faster per weight gradient
    (float32 and bfloat16, N = 16 to 1024); with M = 2048 on both cores 0.87-1.17x. The MoE
    decoder's train step of benchmarks/bench_models.py, with the router's logits through this
    too, took 0.935x the time on 8 simulated devices (256 rows each) and 0.99x on one device
    (same-process A/Bs). Elsewhere (GPU) the
    dot reads the transposed `a` without a copy.
    """
    if jax.default_backend() == "cpu":
        a = jax.lax.optimization_barrier(jnp.transpose(a))
        return _matmul_reference(mode, a, b, False, False, like=like)
    return _matmul_reference(mode, a, b, True, False, like=like)


# -------------------------------------------------------------------------------------------------
# Forward and backward on 2-D operands: x [M, K], w [K, N] (or [N, K]), bias [N] | None.


def _forward(cfg: _Config, x, w, bias, save: bool):
    """Returns (y, residual): residual is what the backward needs of the activation (or None)."""
    act = cfg.activation
    if not cfg.kernel:
        h = _matmul_reference(cfg.mode, x, w, False, cfg.transpose_w)
        if bias is not None:
            h = h + bias.astype(jnp.float32)
        y = activate(act, h).astype(x.dtype)
        if act is None or not save:
            return y, None
        return y, (y if act == "relu" else h.astype(x.dtype))
    n = w.shape[0] if cfg.transpose_w else w.shape[1]
    fused = act in ("relu", "gelu_tanh") and not (act == "gelu_tanh" and save and n % 8 != 0)
    if fused:
        with_aux = save and act == "gelu_tanh"
        y, h, _ = gemm_call(
            cfg.mode, x, w, bias, transpose_b=cfg.transpose_w, activation=act, aux=with_aux
        )
        if not save:
            return y, None
        return y, (y if act == "relu" else h)
    h, _, _ = gemm_call(cfg.mode, x, w, bias, transpose_b=cfg.transpose_w)
    if act is None:
        return h, None
    y = activate(act, h.astype(jnp.float32)).astype(x.dtype)
    return y, (h if save else None)


def _backward(cfg: _Config, x, w, has_bias: bool, residual, dy):
    act = cfg.activation
    if act is None:
        dh = dy
    elif act == "relu":
        dh = jnp.where(residual > 0, dy, jnp.zeros_like(dy))
    else:
        dh = (dy.astype(jnp.float32) * activation_grad(act, residual.astype(jnp.float32))).astype(
            dy.dtype
        )
    if not cfg.kernel:
        dx = _matmul_reference(cfg.mode, dh, w, False, not cfg.transpose_w).astype(x.dtype)
        if cfg.transpose_w:
            dw = _weight_grad(cfg.mode, dh, x, like=w)
        else:
            dw = _weight_grad(cfg.mode, x, dh, like=w)
        db = jnp.sum(dh.astype(jnp.float32), axis=0) if has_bias else None
        return dx, dw.astype(w.dtype), db
    dx, _, _ = gemm_call(cfg.mode, dh, w, None, transpose_b=not cfg.transpose_w)
    if cfg.transpose_w:  # dw [N, K] = dh^T x; the bias gradient as an XLA reduction
        dw, _, _ = gemm_call(cfg.mode, dh, x, None, transpose_a=True)
        db = jnp.sum(dh.astype(jnp.float32), axis=0) if has_bias else None
    else:  # dw [K, N] = x^T dh, the bias gradient (sum of dh over rows) fused as BGRADA
        dw, _, db = gemm_call(cfg.mode, x, dh, None, transpose_a=True, bias_grad=has_bias)
    return dx, dw, db


# -------------------------------------------------------------------------------------------------
# custom_vmap and custom_partitioning of the CUDA path (a single callable per configuration).


def _local_forward(cfg: _Config, has_bias: bool, save: bool):
    def run(x, w, bias):
        y, residual = _forward(cfg, x, w, bias if has_bias else None, save)
        return (y, residual) if save and residual is not None else (y,)

    return run


def _sharding_rule(cfg: _Config, has_bias: bool, n_results: int) -> str:
    w_rule = "n k" if cfg.transpose_w else "k n"
    operands = ["m k", w_rule] + (["n"] if has_bias else ["z"])
    return ", ".join(operands) + " -> " + ", ".join(["m n"] * n_results)


@functools.cache
def _partitioned_forward(cfg: _Config, has_bias: bool, save: bool, n_results: int):
    local = _local_forward(cfg, has_bias, save)

    def fn(x, w, bias):
        return local(x, w, bias)

    def specs(mesh, arg_shapes):
        x_spec = padded_spec(arg_shapes[0].sharding, 2)
        w_spec = padded_spec(arg_shapes[1].sharding, 2)
        k_entries = (x_spec[1], w_spec[1] if cfg.transpose_w else w_spec[0])
        n_entry = w_spec[0] if cfg.transpose_w else w_spec[1]
        if any(entry is not None for entry in k_entries):
            raise InvalidArgumentError(
                "jaxops.gemm: the contraction axis K is sharded "
                f"(x {x_spec}, w {w_spec}); jaxops.gemm keeps rows of x and columns of w local "
                "and does not gather or reduce K. Shard K inside shard_map and psum the partial "
                "products, or pass impl='xla'"
            )
        return x_spec[0], n_entry

    def partition(mesh, arg_shapes, result_shape):
        m_entry, n_entry = specs(mesh, arg_shapes)
        x_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(m_entry, None))
        if cfg.transpose_w:
            w_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(n_entry, None))
        else:
            w_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, n_entry))
        b_spec = jax.sharding.PartitionSpec(n_entry if has_bias else None)
        b_sh = jax.sharding.NamedSharding(mesh, b_spec)
        out_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(m_entry, n_entry))
        return mesh, local, (out_sh,) * n_results, (x_sh, w_sh, b_sh)

    def infer(mesh, arg_shapes, result_shape):
        m_entry, n_entry = specs(mesh, arg_shapes)
        out_sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(m_entry, n_entry))
        return (out_sh,) * n_results

    partitioned = custom_partitioning(fn)
    partitioned.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=_sharding_rule(cfg, has_bias, n_results),
    )
    return partitioned


def _n_forward_results(cfg: _Config, save: bool) -> int:
    return 2 if save and cfg.activation is not None else 1


def _forward_op(cfg: _Config, has_bias: bool, save: bool):
    """The forward of the CUDA path for 2-D x, with vmap and sharding rules."""
    n_results = _n_forward_results(cfg, save)
    partitioned = _partitioned_forward(cfg, has_bias, save, n_results)

    @custom_vmap
    def op(x, w, bias):
        return partitioned(x, w, bias)

    @op.def_vmap
    def rule(axis_size, in_batched, x, w, bias):
        if not in_batched[1] and not in_batched[2]:
            # Only x is batched: fold the batch into the rows.
            b, m, k = x.shape
            outs = op(x.reshape(b * m, k), w, bias)
            return tuple(o.reshape(b, m, o.shape[-1]) for o in outs), (True,) * len(outs)
        args = [
            a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, batched in zip((x, w, bias), in_batched, strict=True)
        ]
        outs = jax.lax.map(lambda t: op(*t), tuple(args))
        return outs, (True,) * len(outs)

    return op


def _apply_forward(cfg: _Config, x, w, bias, save: bool):
    if not cfg.kernel:
        return _forward(cfg, x, w, bias, save)
    has_bias = bias is not None
    bias_operand = bias if has_bias else jnp.zeros((0,), x.dtype)
    outs = _forward_op(cfg, has_bias, save)(x, w, bias_operand)
    return outs[0], (outs[1] if len(outs) > 1 else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gemm(cfg: _Config, x, w, bias):
    return _apply_forward(cfg, x, w, bias, save=False)[0]


def _gemm_fwd(cfg: _Config, x, w, bias):
    y, residual = _apply_forward(cfg, x, w, bias, save=True)
    return y, (x, w, bias, residual)


def _gemm_bwd(cfg: _Config, saved, dy):
    x, w, bias, residual = saved
    dx, dw, db = _backward(cfg, x, w, bias is not None, residual, dy)
    db = None if bias is None else cotangent_like(db.astype(bias.dtype), bias)
    # Inside shard_map, a weight shared by every device (invariant) gets the psum of the partial
    # gradients; a cotangent takes its primal's varying axes.
    return cotangent_like(dx, x), cotangent_like(dw, w), db


_gemm.defvjp(_gemm_fwd, _gemm_bwd)


# -------------------------------------------------------------------------------------------------
# Public GEMM.


def _check_mode(op: str, precision: Any) -> str:
    if precision is None:
        return current_precision()
    if not isinstance(precision, str) or precision not in MODES:
        raise InvalidArgumentError(
            f"{op}: precision must be None or one of {MODES}, got {precision!r}"
        )
    return current_precision() if precision == "default" else precision


def gemm(
    x: jax.Array,
    w: jax.Array,
    bias: jax.Array | None = None,
    *,
    activation: str | None = None,
    transpose_w: bool = False,
    precision: str | None = None,
    impl: str | None = None,
) -> jax.Array:
    """``act(x @ w + bias)`` with the bias and activation fused into the GEMM on CUDA.

    fp32 accumulation; bias and activation applied in fp32; the result in x's dtype. On CUDA a
    cuBLASLt custom call (relu and gelu_tanh fused in its epilogue, gelu and silu as one XLA
    elementwise pass); on CPU XLA's dot, the fastest CPU GEMM (the pure-JAX twin). Differentiable:
    the backward reuses the pre-activation the forward saved (never recomputes the GEMM), runs
    dgrad and wgrad as GEMMs, and on CUDA fuses the bias gradient into the wgrad GEMM.

    Args:
      x: float32, bfloat16 or float16 ``[..., K]``; leading axes are rows.
      w: x's dtype, ``[K, N]``, or ``[N, K]`` with ``transpose_w`` (a PyTorch-style weight).
      bias: None or x's dtype ``[N]``.
      activation: None, "relu", "gelu" (exact, erf), "gelu_tanh" or "silu".
      transpose_w: w is stored ``[N, K]``.
      precision: None (the :func:`jaxops.precision` scope / process default), or one of "fp32",
        "tf32", "bf16", "bf16_3x", "default": how float32 operands are multiplied. Traced into the
        program (an attribute of the custom call, the precision config of XLA's dot).
      impl: None (global default), "ffi" (require the custom call) or "xla" (the twin).

    Returns:
      ``[..., N]`` in x's dtype.

    Raises:
      TypeError / ValueError: wrong dtypes, ranks, mismatched K, bad bias shape, unknown
        activation or precision.

    Example:
      >>> import jax, jax.numpy as jnp, jaxops
      >>> x = jax.random.normal(jax.random.key(0), (8, 64), jnp.bfloat16)
      >>> w = jax.random.normal(jax.random.key(1), (64, 32), jnp.bfloat16)
      >>> jaxops.gemm(x, w, jnp.zeros(32, jnp.bfloat16), activation="gelu").shape
      (8, 32)
    """
    op = "jaxops.gemm"
    x, w, bias, activation, transpose_w, n = check_dense(op, x, w, bias, activation, transpose_w)
    mode = _check_mode(op, precision)
    k = x.shape[-1]
    available = kernel_available()
    choice = resolve_impl(impl, kernel_available=available, op=op)
    rows = math.prod(x.shape[:-1])
    kernel = (
        choice == "ffi"
        and not (x.dtype == np.dtype(np.float32) and mode == "bf16_3x")
        and rows > 0
        and n > 0
        and k > 0
    )
    if kernel and mode == "default":
        mode = "tf32"  # XLA's default for float32 on Hopper, and what cuBLASLt's "fast" mode does
    cfg = _Config(activation, transpose_w, mode, kernel)
    y = _gemm(cfg, x.reshape(rows, k), w, bias)
    return unflatten_rows(y, x)


def gemm_reference(
    x: jax.Array, w: jax.Array, bias: jax.Array | None = None, **kwargs: Any
) -> jax.Array:
    """The pure-JAX twin of :func:`gemm`: its arguments but `impl` (XLA's dot, same precision)."""
    return gemm(x, w, bias, impl="xla", **kwargs)


_checks.twin_signature(gemm_reference, gemm)
