"""GEMM with fused epilogues and FP8 GEMM (per-tensor and block-scaled) on cuBLASLt.

Public API: :func:`jaxops.gemm` (and its twin :func:`jaxops.gemm_reference`),
``jaxops.fp8.gemm`` and ``jaxops.fp8.linear``.

Where each runs:

- **CUDA** (jaxops built with cuBLASLt): the ``jaxops_gemm`` / ``jaxops_gemm_fp8`` custom calls.
  cuBLASLt fuses bias, relu and gelu_tanh (its GELU is the tanh approximation) into the GEMM and
  writes the pre-activation as the epilogue's auxiliary output when a backward needs it. exact
  "gelu" and "silu" have no cuBLASLt epilogue: the GEMM fuses the bias and XLA applies the
  activation in one elementwise pass. The backward runs dgrad and wgrad as custom calls too, the
  wgrad with the bias-gradient epilogue (BGRADA) fused; the activation derivative is one XLA
  elementwise pass over the saved pre-activation. (cuBLASLt's DGELU epilogue applies to the output
  of the *next* layer's dgrad GEMM, which a single op does not own.)
- **CPU**: XLA's own dot is the best CPU GEMM here, so the CPU path is the pure-JAX composition
  (the twin), documented as such; the CUDA path is tested against it.
- FP8: cuBLASLt's scaled FP8 matmul, per tensor (``SCALAR_32F``) or with block scales
  (``VEC128_32F`` for 1 x 128 groups along K, ``BLK128x128_32F`` for 128 x 128 tiles; cuBLAS
  >= 12.9 on sm_90), so no kernel of our own is needed on Hopper. Problems cuBLASLt cannot take
  (K not a multiple of 16, or of 128 with block scales; a float32 output; both operands e5m2) run
  the reference: dequantize + dot, in float32.

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

from jaxops import _checks, _ffi
from jaxops._config import resolve_impl
from jaxops._fp8 import QuantizedArray, dequantize, quantize
from jaxops._fp8.scales import GRAD_AMAX_FLOOR
from jaxops._precision import MODES, current_precision, dot_precision
from jaxops._sharding import cotangent_like, padded_spec, vary_like

__all__ = [
    "ACTIVATIONS",
    "TARGET_GEMM",
    "TARGET_GEMM_FP8",
    "fp8_gemm",
    "fp8_gemm_reference",
    "fp8_linear",
    "gemm",
    "gemm_reference",
]

TARGET_GEMM = "jaxops_gemm"
TARGET_GEMM_FP8 = "jaxops_gemm_fp8"

ACTIVATIONS: tuple[str | None, ...] = (None, "relu", "gelu", "gelu_tanh", "silu")
# Activations the cuBLASLt epilogue applies (gemm::Activation); the others run in XLA.
_LT_ACTIVATION = {None: 0, "relu": 1, "gelu_tanh": 2}
# jaxops precision mode -> gemm::Precision (float32 operands). bf16_3x runs XLA's dot.
_LT_PRECISION = {"fp32": 0, "tf32": 1, "bf16": 2}
_SCALE_MODE = {"tensor": 0, "rows": 1, "tiles": 2}  # gemm::ScaleMode
_WORKSPACE_BYTES = 32 << 20  # gemm::kWorkspaceBytes
_FP8_BLOCK = 128


# -------------------------------------------------------------------------------------------------
# Activations (fp32 in, fp32 out) and their derivatives.


def _activate(activation: str | None, h: jax.Array) -> jax.Array:
    if activation is None:
        return h
    if activation == "relu":
        return jnp.maximum(h, 0.0)
    if activation == "gelu":
        return jax.nn.gelu(h, approximate=False)
    if activation == "gelu_tanh":
        return jax.nn.gelu(h, approximate=True)
    return jax.nn.silu(h)


def _activation_grad(activation: str | None, h: jax.Array) -> jax.Array:
    """D act / d h at the (float32) pre-activation h."""
    if activation is None:
        return jnp.ones_like(h)
    if activation == "relu":
        return (h > 0).astype(h.dtype)
    if activation == "silu":
        s = jax.nn.sigmoid(h)
        return s * (1.0 + h * (1.0 - s))
    if activation == "gelu":
        cdf = 0.5 * (1.0 + jax.lax.erf(h / math.sqrt(2.0)))
        pdf = jnp.exp(-0.5 * h * h) / math.sqrt(2.0 * math.pi)
        return cdf + h * pdf
    c = math.sqrt(2.0 / math.pi)
    inner = c * (h + 0.044715 * h**3)
    t = jnp.tanh(inner)
    return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * h * h)


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


def _lt_gemm(
    cfg: _Config,
    a,
    b,
    bias,
    *,
    transpose_a: bool = False,
    transpose_b: bool = False,
    activation: str | None = None,
    aux: bool = False,
    bias_grad: bool = False,
):
    """One ``jaxops_gemm`` custom call; returns (d, aux | None, bias_grad | None)."""
    _ffi.ensure_registered(TARGET_GEMM)
    m = a.shape[1] if transpose_a else a.shape[0]
    n = b.shape[0] if transpose_b else b.shape[1]
    dtype = a.dtype
    empty = jnp.zeros((0,), dtype)
    out_types = [
        jax.ShapeDtypeStruct((m, n), dtype),
        jax.ShapeDtypeStruct((m, n) if aux else (0,), dtype),
        jax.ShapeDtypeStruct((n,) if bias_grad else (0,), dtype),
        jax.ShapeDtypeStruct((_WORKSPACE_BYTES,), jnp.uint8),
    ]
    d, aux_out, bias_grad_out, _ = _ffi.ffi_call(
        TARGET_GEMM,
        out_types,
        a,
        b,
        empty if bias is None else bias,
        vmap_method="sequential",
        transpose_a=bool(transpose_a),
        transpose_b=bool(transpose_b),
        activation=np.int32(_LT_ACTIVATION[activation]),
        precision=np.int32(_LT_PRECISION[cfg.mode]),
    )
    return d, (aux_out if aux else None), (bias_grad_out if bias_grad else None)


# -------------------------------------------------------------------------------------------------
# Forward and backward on 2-D operands: x [M, K], w [K, N] (or [N, K]), bias [N] | None.


def _forward(cfg: _Config, x, w, bias, save: bool):
    """Returns (y, residual): residual is what the backward needs of the activation (or None)."""
    act = cfg.activation
    if not cfg.kernel:
        h = _matmul_reference(cfg.mode, x, w, False, cfg.transpose_w)
        if bias is not None:
            h = h + bias.astype(jnp.float32)
        y = _activate(act, h).astype(x.dtype)
        if act is None or not save:
            return y, None
        return y, (y if act == "relu" else h.astype(x.dtype))
    n = w.shape[0] if cfg.transpose_w else w.shape[1]
    fused = act in ("relu", "gelu_tanh") and not (act == "gelu_tanh" and save and n % 8 != 0)
    if fused:
        with_aux = save and act == "gelu_tanh"
        y, h, _ = _lt_gemm(
            cfg, x, w, bias, transpose_b=cfg.transpose_w, activation=act, aux=with_aux
        )
        if not save:
            return y, None
        return y, (y if act == "relu" else h)
    h, _, _ = _lt_gemm(cfg, x, w, bias, transpose_b=cfg.transpose_w)
    if act is None:
        return h, None
    y = _activate(act, h.astype(jnp.float32)).astype(x.dtype)
    return y, (h if save else None)


def _backward(cfg: _Config, x, w, has_bias: bool, residual, dy):
    act = cfg.activation
    if act is None:
        dh = dy
    elif act == "relu":
        dh = jnp.where(residual > 0, dy, jnp.zeros_like(dy))
    else:
        dh = (dy.astype(jnp.float32) * _activation_grad(act, residual.astype(jnp.float32))).astype(
            dy.dtype
        )
    if not cfg.kernel:
        dx = _matmul_reference(cfg.mode, dh, w, False, not cfg.transpose_w).astype(x.dtype)
        if cfg.transpose_w:
            dw = _matmul_reference(cfg.mode, dh, x, True, False, like=w)
        else:
            dw = _matmul_reference(cfg.mode, x, dh, True, False, like=w)
        db = jnp.sum(dh.astype(jnp.float32), axis=0) if has_bias else None
        return dx, dw.astype(w.dtype), db
    dx, _, _ = _lt_gemm(cfg, dh, w, None, transpose_b=not cfg.transpose_w)
    if cfg.transpose_w:  # dw [N, K] = dh^T x; the bias gradient as an XLA reduction
        dw, _, _ = _lt_gemm(cfg, dh, x, None, transpose_a=True)
        db = jnp.sum(dh.astype(jnp.float32), axis=0) if has_bias else None
    else:  # dw [K, N] = x^T dh, the bias gradient (sum of dh over rows) fused as BGRADA
        dw, _, db = _lt_gemm(cfg, x, dh, None, transpose_a=True, bias_grad=has_bias)
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
            raise ValueError(
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


def _check_activation(op: str, activation: Any) -> str | None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation


def _check_mode(op: str, precision: Any) -> str:
    if precision is None:
        return current_precision()
    if not isinstance(precision, str) or precision not in MODES:
        raise ValueError(f"{op}: precision must be None or one of {MODES}, got {precision!r}")
    return current_precision() if precision == "default" else precision


def _gemm_kernel_available() -> bool:
    backend = jax.default_backend()
    if backend not in ("gpu", "cuda") or not _ffi.kernel_available(backend):
        return False
    return _ffi.build_info().get("CUDA", {}).get("cublaslt") is not None


def _validate_gemm(op, x, w, bias, activation, transpose_w):
    x = _checks.check_array(op, "x", x, min_rank=1)
    w = _checks.check_array(op, "w", w)
    if w.ndim != 2:
        raise ValueError(f"{op}: w must be a matrix [K, N] (or [N, K]), got shape {w.shape}")
    if w.dtype != x.dtype:
        raise TypeError(f"{op}: w must have x's dtype {x.dtype}, got {w.dtype}")
    transpose_w = _checks.check_bool(op, "transpose_w", transpose_w)
    k = x.shape[-1]
    w_k, n = (w.shape[1], w.shape[0]) if transpose_w else w.shape
    if w_k != k:
        layout = "[N, K]" if transpose_w else "[K, N]"
        raise ValueError(
            f"{op}: w must be {layout} with K = x.shape[-1] = {k}; got w of shape {w.shape}"
        )
    if bias is not None:
        bias = _checks.check_array(op, "bias", bias)
        if bias.shape != (n,) or bias.dtype != x.dtype:
            raise ValueError(
                f"{op}: bias must be [{n}] with x's dtype {x.dtype}; got {bias.shape} {bias.dtype}"
            )
    return x, w, bias, _check_activation(op, activation), transpose_w, n


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
    x, w, bias, activation, transpose_w, n = _validate_gemm(op, x, w, bias, activation, transpose_w)
    mode = _check_mode(op, precision)
    k = x.shape[-1]
    available = _gemm_kernel_available()
    choice = resolve_impl(impl, kernel_available=available)
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
    return y.reshape(*x.shape[:-1], n)


def gemm_reference(
    x: jax.Array,
    w: jax.Array,
    bias: jax.Array | None = None,
    *,
    activation: str | None = None,
    transpose_w: bool = False,
    precision: str | None = None,
) -> jax.Array:
    """The pure-JAX twin of :func:`gemm` (same arguments; XLA's dot with the same precision)."""
    return gemm(
        x, w, bias, activation=activation, transpose_w=transpose_w, precision=precision, impl="xla"
    )


# -------------------------------------------------------------------------------------------------
# FP8 GEMM.


def _operand_mode(op: str, name: str, q: QuantizedArray, k_axis_of_data: int) -> str:
    """The scaling mode of `q` along the contraction, or a clear error."""
    if q.block is None:
        return "tensor"
    if q.block == (_FP8_BLOCK, _FP8_BLOCK):
        return "tiles"
    if q.block == (1, _FP8_BLOCK) and k_axis_of_data == 1:
        return "rows"
    raise ValueError(
        f"{op}: {name} must be quantized per tensor, in 1 x 128 groups along K or in 128 x 128 "
        f"tiles; got block={q.block} with transposed={q.transposed} (its groups run along "
        f"{'K' if k_axis_of_data == 1 else 'the non-contracted axis'})"
    )


def _kernel_scale(mode: str, q: QuantizedArray, transpose_data: bool) -> jax.Array:
    """Q's scales as the kernel takes them: [KB, pad4(row blocks)], row blocks contiguous."""
    scale = q.scale.astype(jnp.float32)
    if mode == "tensor":
        return scale.reshape(())
    # Our layouts, in data's coordinates: "row" [RB, KB], "col_tma" [KB, pad4(RB)].
    grid = jnp.swapaxes(scale, -1, -2) if q.scale_layout == "col_tma" else scale
    rows = q.data.shape[0] if mode == "rows" else -(-q.data.shape[0] // _FP8_BLOCK)
    grid = grid[:rows] if q.scale_layout == "col_tma" else grid
    if transpose_data:  # tiles: the tile grid transposes with the data
        grid = grid.T
    kernel = grid.T  # [KB, RB]
    pad = (-kernel.shape[1]) % 4
    return jnp.pad(kernel, ((0, 0), (0, pad))) if pad else kernel


def _fp8_reference(a, b, bias, activation, out_dtype):
    y = jnp.matmul(
        dequantize(a, jnp.float32),
        dequantize(b, jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return _activate(activation, y).astype(out_dtype)


def _fp8_validate(op, a, b, bias, activation, out_dtype):
    for name, q in (("a", a), ("b", b)):
        if not isinstance(q, QuantizedArray):
            raise TypeError(
                f"{op}: {name} must be a jaxops.fp8.QuantizedArray, got {type(q).__name__}"
            )
        if len(q.shape) != 2:
            raise ValueError(f"{op}: {name} must be a matrix, got logical shape {q.shape}")
    (m, k), (b_k, n) = a.shape, b.shape
    if b_k != k:
        raise ValueError(f"{op}: a [M, K] and b [K, N] must share K; got {a.shape} and {b.shape}")
    out = np.dtype(out_dtype)
    if out not in _checks.FLOAT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be float32, bfloat16 or float16; got {out.name}")
    activation = _check_activation(op, activation)
    if bias is not None:
        bias = _checks.check_array(op, "bias", bias)
        if bias.shape != (n,):
            raise ValueError(f"{op}: bias must be [{n}], got {bias.shape}")
    # a's data [M, K] holds K on axis 1 unless transposed; b's logical [K, N] holds K on axis 1
    # of its data only when transposed (data [N, K]).
    a_mode = _operand_mode(op, "a", a, 0 if a.transposed else 1)
    b_mode = _operand_mode(op, "b", b, 1 if b.transposed else 0)
    if (a_mode == "tensor") != (b_mode == "tensor"):
        raise ValueError(
            f"{op}: a and b must both be per-tensor or both block-scaled; got {a_mode} and {b_mode}"
        )
    if a_mode == b_mode == "tiles":
        raise ValueError(f"{op}: at most one of a and b may use 128 x 128 tiles (cuBLASLt)")
    return m, k, n, out, activation, bias, a_mode, b_mode


def fp8_gemm(
    a: QuantizedArray,
    b: QuantizedArray,
    *,
    bias: jax.Array | None = None,
    activation: str | None = None,
    out_dtype: Any = jnp.bfloat16,
    impl: str | None = None,
) -> jax.Array:
    """``act(dequant(a) @ dequant(b) + bias)`` on FP8 tensor cores, fp32 accumulation.

    Scalings: both per tensor (``block=None``), or block-scaled with at most one operand in
    128 x 128 tiles — the DeepSeek-V3 recipe is a in 1 x 128 groups along K
    (``quantize(x, block=(1, 128))``) and b in 128 x 128 tiles. On CUDA: cuBLASLt's scaled FP8
    matmul (block modes of cuBLAS >= 12.9 on sm_90). Hopper's FP8 tensor cores take both operands
    K-major: b is best given as the transposed copy (``quantize(w, ..., transpose=True)[1]``,
    data ``[N, K]``); a b whose data is ``[K, N]`` is transposed by XLA first (tiles only; a
    1 x 128 b must group along K). Elsewhere, and for problems cuBLASLt cannot take (see the module
    docstring), the reference: dequantize both, multiply in float32.

    Args:
      a: QuantizedArray, logical ``[M, K]``.
      b: QuantizedArray, logical ``[K, N]``.
      bias: None or ``[N]`` (any float dtype; added in fp32).
      activation: None, "relu", "gelu", "gelu_tanh" or "silu".
      out_dtype: bfloat16 (default), float16 or float32 (float32 runs the reference).
      impl: None, "ffi" or "xla".

    Returns:
      ``[M, N]`` in out_dtype.

    Raises:
      TypeError / ValueError: operands that are not QuantizedArrays, mismatched K, a block layout
        the GEMM cannot take (groups not along K, two tiled operands, per-tensor mixed with
        blocks), bad bias or out_dtype.

    Example:
      >>> import jax, jax.numpy as jnp, jaxops
      >>> x = jax.random.normal(jax.random.key(0), (64, 256), jnp.bfloat16)
      >>> w = jax.random.normal(jax.random.key(1), (256, 128), jnp.bfloat16)
      >>> qa = jaxops.fp8.quantize(x, block=(1, 128))
      >>> qb = jaxops.fp8.quantize(w, block=(128, 128), transpose=True)[1]
      >>> jaxops.fp8.gemm(qa, qb).shape
      (64, 128)
    """
    op = "jaxops.fp8.gemm"
    m, k, n, out, activation, bias, a_mode, b_mode = _fp8_validate(
        op, a, b, bias, activation, out_dtype
    )
    available = _gemm_kernel_available()
    choice = resolve_impl(impl, kernel_available=available)
    both_e5m2 = a.dtype == b.dtype == np.dtype(jnp.float8_e5m2)
    blocked = a_mode != "tensor"
    kernel = (
        choice == "ffi"
        and out != np.dtype(np.float32)
        and not both_e5m2
        and m > 0
        and n > 0
        and k % (_FP8_BLOCK if blocked else 16) == 0
        and k > 0
    )
    if not kernel:
        return _fp8_reference(a, b, bias, activation, out)
    _ffi.ensure_registered(TARGET_GEMM_FP8)
    a_data = jnp.swapaxes(a.data, 0, 1) if a.transposed else a.data  # [M, K]
    b_data = b.data if b.transposed else jnp.swapaxes(b.data, 0, 1)  # [N, K]
    a_scale = _kernel_scale(a_mode, a, a.transposed)
    b_scale = _kernel_scale(b_mode, b, not b.transposed)
    lt_act = activation if activation in _LT_ACTIVATION else None
    bias_operand = jnp.zeros((0,), out) if bias is None else bias.astype(out)
    y, _ = _ffi.ffi_call(
        TARGET_GEMM_FP8,
        [jax.ShapeDtypeStruct((m, n), out), jax.ShapeDtypeStruct((_WORKSPACE_BYTES,), jnp.uint8)],
        a_data,
        b_data,
        a_scale,
        b_scale,
        bias_operand,
        vmap_method="sequential",
        a_scale_mode=np.int32(_SCALE_MODE[a_mode]),
        b_scale_mode=np.int32(_SCALE_MODE[b_mode]),
        activation=np.int32(_LT_ACTIVATION[lt_act]),
    )
    if activation != lt_act:
        y = _activate(activation, y.astype(jnp.float32)).astype(out)
    return y


def fp8_gemm_reference(
    a: QuantizedArray,
    b: QuantizedArray,
    *,
    bias: jax.Array | None = None,
    activation: str | None = None,
    out_dtype: Any = jnp.bfloat16,
) -> jax.Array:
    """The twin of :func:`fp8_gemm`: dequantize both operands, multiply in float32."""
    return fp8_gemm(a, b, bias=bias, activation=activation, out_dtype=out_dtype, impl="xla")


# -------------------------------------------------------------------------------------------------
# fp8.linear: a differentiable FP8 layer.


@dataclasses.dataclass(frozen=True)
class _LinearConfig:
    activation: str | None
    recipe: str  # "block" or "tensor"
    impl: str | None


def _quantize_pair(cfg: _LinearConfig, x, *, weight: bool, grad: bool):
    """(q, q_t): x and its transpose quantized in one pass, as the recipe wants them."""
    if cfg.recipe == "tensor":
        block = None
        dtype = jnp.float8_e5m2 if grad else jnp.float8_e4m3fn
    else:
        block = (_FP8_BLOCK, _FP8_BLOCK) if weight else (1, _FP8_BLOCK)
        dtype = jnp.float8_e4m3fn
    floor = GRAD_AMAX_FLOOR if grad else 1e-4
    return quantize(x, dtype=dtype, block=block, transpose=True, amax_floor=floor, impl=cfg.impl)


def _linear_forward(cfg: _LinearConfig, x, w, bias):
    qx, qx_t = _quantize_pair(cfg, x, weight=False, grad=False)
    qw, qw_t = _quantize_pair(cfg, w, weight=True, grad=False)
    # Forward: x [M, K] @ w [K, N]; b = w as data [N, K] (the transposed copy).
    h = fp8_gemm(qx, qw_t, bias=bias, activation=None, out_dtype=jnp.float32, impl=cfg.impl)
    y = _activate(cfg.activation, h)
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
    dh = (dy.astype(jnp.float32) * _activation_grad(cfg.activation, h.astype(jnp.float32))).astype(
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


def fp8_linear(
    x: jax.Array,
    w: jax.Array,
    bias: jax.Array | None = None,
    *,
    activation: str | None = None,
    recipe: str = "block",
    impl: str | None = None,
) -> jax.Array:
    """A differentiable FP8 dense layer: ``act(x @ w + bias)`` with FP8 GEMMs forward and backward.

    recipe="block" (DeepSeek-V3): x and the output gradient in 1 x 128 groups, w in 128 x 128
    tiles, all float8_e4m3fn. recipe="tensor": per-tensor current scaling, e4m3 forward and e5m2
    gradients. Each tensor is quantized once together with its transpose (the fused
    transpose-quantize of ``jaxops.fp8.quantize``): the forward uses x and wᵀ's copy, dgrad the
    output gradient and w, wgrad xᵀ and the gradient's transpose. Accumulation is fp32; the
    bias and activation are applied in fp32.

    Args:
      x: float32, bfloat16 or float16 ``[..., K]``.
      w: x's dtype ``[K, N]``.
      bias: None or ``[N]``.
      activation: None, "relu", "gelu", "gelu_tanh" or "silu".
      recipe: "block" or "tensor".
      impl: None, "ffi" or "xla" (quantization and GEMMs).

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
    x, w, bias, activation, _, n = _validate_gemm(op, x, w, bias, activation, False)
    if recipe not in ("block", "tensor"):
        raise ValueError(f"{op}: recipe must be 'block' or 'tensor', got {recipe!r}")
    cfg = _LinearConfig(activation, recipe, impl)
    k = x.shape[-1]
    y = _linear(cfg, x.reshape(-1, k), w, bias)
    return y.reshape(*x.shape[:-1], n)
