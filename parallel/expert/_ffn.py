"""The expert FFNs: activations, the grouped GEMMs (bf16 / FP8, with their VJP), the shared expert.

Rows arrive grouped by local expert, each group padded to a multiple of the plan's alignment.
XLA lowers ``jax.lax.ragged_dot`` to one dense dot over every group for every row (masked), L
times the work and a float32 ``[L, R, K]`` operand. jaxops' grouped GEMM custom calls
(:mod:`jaxops._grouped_gemm`: the forward, the input gradient with the weights read transposed,
the weight gradient) compute each group's rows only: on XLA:CPU over groups of any size, on GPU
(with the CUDA module; first run on an H200 on 2026-11-30) over groups padded to 64-row
tiles. On a GPU without it the grouped GEMM is ragged_dot while that operand is small (the
plan's tile is then 0: ``GPU_RAGGED_DOT_MAX_BYTES`` in :mod:`._exchange`), else the loop below.
With ``impl="xla"`` (or that GPU fallback) the calls' twin runs instead: each group cut
into chunks, as many of 8 tiles as fit, then at most 3 of 2 tiles or 1; a loop over the
non-empty groups slices each group's weights once and runs one GEMM per chunk (dynamic trip
counts: the work follows the rows actually received, not the buffer's worst-case size), and the
backward computes a chunk's input and weight gradients in the same trip, each group's weight
gradient summed in a ``[K, N]`` carry and written once. With ``fp8="block"`` the GEMMs use
DeepSeek-V3's block-scaled FP8 numerics: on an sm_90 GPU with ``JAXOPS_GPU_GROUPED_GEMM=cutlass``
the three GEMMs run on FP8 tensor cores (CUTLASS's block-scaled grouped GEMMs,
:func:`jaxops._grouped_gemm.grouped_gemm_fp8` and ``grouped_gemm_fp8_wgrad``; compiled, not yet
run on a GPU), elsewhere the quantized operands are dequantized and multiplied in float32.
Expert biases (``MoEConfig.expert_bias``) are added in float32 to the GEMMs' float32 outputs, each
row taking its group's bias; padding rows take none, so they stay zero as without biases. On
XLA:CPU the activation between the GEMMs (the SiLU family: swiglu, clamped_swiglu, silu) runs as
jaxops' grouped activation calls, on the groups' rows only (the buffer is sized for the routing's
worst case: on 8 simulated devices the gather exchange's buffer held about 526 rows of groups in
2076); elsewhere, and for gelu, XLA's fusion computes it on every row.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxops import _grouped_gemm, fp8
from jaxops._config import resolve_impl
from jaxops._fp8.scales import AMAX_FLOOR, GRAD_AMAX_FLOOR
from jaxops._sharding import cotangent_like, vary_like

from ._config import FP8_BLOCK, MoEConfig

__all__ = ["CPU_TILE", "GPU_TILE", "activate", "expert_ffn", "grouped_ffn", "shared_expert"]

#: Row tile of the grouped GEMM loop off GPU (impl "xla": groups padded to it, its smallest
#: chunk; the CPU custom calls take groups of any size). 0 in a plan: jax.lax.ragged_dot.
CPU_TILE = 32
#: The same on GPU where the plan does not take ragged_dot (the loop's chunks: 512, 128, 64).
GPU_TILE = 64


def activate(cfg: MoEConfig, h: jax.Array) -> jax.Array:
    """cfg.activation on the first projection's output ``[..., F']`` -> ``[..., F]``.

    Every activation maps 0 to 0 (padding rows stay zero). "clamped_swiglu" is gpt-oss's
    (transformers' ``GptOssExperts._apply_gate``): gate and up interleaved in h's columns. The
    SiLU family is :func:`jaxops._grouped_gemm.activation_reference` (the grouped activation
    calls' twin).
    """
    if cfg.activation == "gelu":
        return jax.nn.gelu(h, approximate=False)
    return _grouped_gemm.activation_reference(h, cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit)


def _activation_kernel(cfg: MoEConfig, tile: int, impl, dtype) -> bool:
    """Whether the grouped activation calls run cfg's activation on h of `dtype` (CPU only).

    Not with impl "xla", and only for float32 h (what the grouped GEMMs return).
    """
    return (
        cfg.activation in _grouped_gemm.ACTIVATIONS
        and jnp.dtype(dtype) == jnp.float32
        and _kernel(tile, impl)
        and _grouped_gemm.activation_kernel_available()
    )


def _checking_floats() -> bool:
    """Whether jax checks every result for NaNs or infs (``jax_debug_nans``, ``jax_debug_infs``).

    Those checks read whole arrays, unwritten rows too: the FFN's intermediates are then zeroed
    after the groups like its outputs, so that only a real NaN is reported.
    """
    return bool(jax.config.jax_debug_nans or jax.config.jax_debug_infs)


def _grouped_activate(
    cfg: MoEConfig, h: jax.Array, group_sizes: jax.Array, zero_tail: bool = True
) -> jax.Array:
    """:func:`activate` on the groups' rows of float32 h in cfg.dtype (zeros after them).

    zero_tail=False: the rows after the groups, of the output and of h's gradient, are left
    unwritten (the caller reads neither there: :func:`grouped_ffn`).
    """
    return _activate_vjp(cfg, zero_tail, h, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _activate_vjp(cfg: MoEConfig, zero_tail: bool, h: jax.Array, group_sizes: jax.Array):
    return _activate_fwd(cfg, zero_tail, h, group_sizes)[0]


def _activate_fwd(cfg: MoEConfig, zero_tail: bool, h, group_sizes):
    a = _grouped_gemm.grouped_activation(
        h,
        group_sizes,
        cfg.activation,
        dtype=cfg.dtype,
        alpha=cfg.swiglu_alpha,
        limit=cfg.swiglu_limit,
        zero_tail=zero_tail,
    )
    return a, (h, group_sizes)


def _activate_bwd(cfg: MoEConfig, zero_tail: bool, saved, da):
    h, group_sizes = saved
    dh = _grouped_gemm.grouped_activation_bwd(
        h,
        da,
        group_sizes,
        cfg.activation,
        alpha=cfg.swiglu_alpha,
        limit=cfg.swiglu_limit,
        zero_tail=zero_tail,
    )
    return cotangent_like(dh, h), None


_activate_vjp.defvjp(_activate_fwd, _activate_bwd)


def _chunks(tile: int, rows: int) -> tuple[int, ...]:
    """The row chunks of the CPU loops, largest first: multiples of `tile` up to `rows`."""
    return (*(c for c in (8 * tile, 2 * tile) if c <= rows), tile)


def _levels(tile: int, rows: int, group_sizes: jax.Array) -> list:
    """Each group's chunks per chunk size c of :func:`_chunks`, largest first.

    Per size ``(c, n, done)``: n int32 ``[L]`` chunks of c rows in group l, the first of them
    starting ``done[l]`` rows into the group. Each group (its size a multiple of `tile`) is
    covered in order by as many chunks of each size as fit in what is left of it, so most rows
    go through large GEMMs and at most 3 smaller chunks end a group, while groups stay padded to
    a multiple of `tile` only.
    """
    done = jnp.zeros_like(group_sizes)
    levels = []
    for c in _chunks(tile, rows):
        n = (group_sizes - done) // c
        levels.append((c, n, done))
        done = done + n * c
    return levels


def _group_loop(tile: int, rows: int, groups, group_body, carry):
    """``group_body(e, each_chunk, carry) -> carry`` for every non-empty group e, in order.

    ``each_chunk(fn, carry)`` runs ``fn(c, first, carry) -> carry`` over group e's chunks:
    c rows from row `first` (an int32 scalar), largest c first (:func:`_levels`). What the
    group body reads per group (its expert's weights) is sliced once per group, not per chunk,
    and empty groups are skipped (a few routed tokens cost a few trips, not L).
    """
    group_sizes, starts = groups
    levels = _levels(tile, rows, group_sizes)
    busy = jnp.nonzero(group_sizes > 0, size=group_sizes.shape[0], fill_value=0)[0]
    count = jnp.sum(group_sizes > 0, dtype=jnp.int32)

    def group(j, carry):
        e = busy[j].astype(jnp.int32)

        def each_chunk(fn, carry):
            for c, n, done in levels:
                first = starts[e] + done[e]
                carry = jax.lax.fori_loop(
                    0, n[e], lambda i, carry, c=c, first=first: fn(c, first + i * c, carry), carry
                )
            return carry

        return group_body(e, each_chunk, carry)

    return jax.lax.fori_loop(0, count, group, carry)


def _kernel(tile: int, impl) -> bool:
    """Whether the grouped GEMMs run jaxops' custom calls (CPU or CUDA; not with impl "xla")."""
    if tile == 0:
        return False
    available = _grouped_gemm.kernel_available()
    return (
        resolve_impl(impl, kernel_available=available, op="jaxops.parallel.expert.moe_layer")
        == "ffi"
    )


def _gmm(
    tile: int, x, w, groups, transpose_w: bool = False, impl=None, zero_tail: bool = True
) -> jax.Array:
    """``y[rows of group l] = x[rows] @ w[l]`` (``w[l].T`` with transpose_w), float32 ``[R, N]``.

    Padding rows give zeros (with the custom calls and zero_tail=False the rows after the groups
    are left unwritten). On XLA:CPU the CPU custom call (:mod:`jaxops._grouped_gemm`), or
    with ``impl="xla"`` its twin: a loop over the groups that runs one GEMM per chunk of their
    rows (:func:`_group_loop`) with the group's weights (with transpose_w the GEMM reads them
    transposed: no transposed copy of w is made).
    """
    group_sizes = groups[0]
    if _kernel(tile, impl):
        dtype = jnp.promote_types(x.dtype, w.dtype)
        return _grouped_gemm.grouped_gemm(
            x.astype(dtype),
            w.astype(dtype),
            group_sizes,
            transpose_w=transpose_w,
            zero_tail=zero_tail,
        )
    if tile == 0:
        w = jnp.swapaxes(w, 1, 2) if transpose_w else w
        return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
    dims = (((1,), (1,)) if transpose_w else ((1,), (0,)), ((), ()))
    n = w.shape[1] if transpose_w else w.shape[2]
    out = vary_like(jnp.zeros((x.shape[0], n), jnp.float32), x, w, group_sizes)

    def group(e, each_chunk, out):
        wg = jax.lax.dynamic_index_in_dim(w, e, keepdims=False)

        def chunk(c, first, out):
            rows = jax.lax.dynamic_slice_in_dim(x, first, c)
            y = jax.lax.dot_general(rows, wg, dims, preferred_element_type=jnp.float32)
            return jax.lax.dynamic_update_slice_in_dim(out, y, first, 0)

        return each_chunk(chunk, out)

    return _group_loop(tile, x.shape[0], groups, group, out)


def _gmm_bwd(
    tile: int, dy, w, x, dy_w, groups, impl=None, dx_zero_tail: bool = True
) -> tuple[jax.Array, jax.Array]:
    """The grouped GEMM's two gradients, float32: ``(dx [R, K], dw [L, K, N])``.

    ``dx[rows of l] = dy[rows] @ w[l].T`` and ``dw[l] = x[rows of l].T @ dy_w[rows of l]``
    (dy_w: the gradient the wgrad reads; dy itself unless quantized differently); dx_zero_tail
    as :func:`_gmm`'s zero_tail. On XLA:CPU
    the CPU custom calls, or with ``impl="xla"`` one loop over the groups that computes both per
    chunk of rows, each group's weight gradient summed in a ``[K, N]`` accumulator and written
    once; groups without rows get zeros.
    """
    group_sizes = groups[0]
    if _kernel(tile, impl):
        dtype = jnp.promote_types(dy.dtype, w.dtype)
        dx = _gmm(tile, dy.astype(dtype), w.astype(dtype), groups, True, impl, dx_zero_tail)
        dtype = jnp.promote_types(x.dtype, dy_w.dtype)
        return dx, _grouped_gemm.grouped_gemm_wgrad(
            x.astype(dtype), dy_w.astype(dtype), group_sizes
        )
    if tile == 0:
        dx = _gmm(tile, dy, w, groups, transpose_w=True)
        # The zero primal varies like the rows: invariant, its gradient would be summed over
        # the shard_map axes the rows vary over (every device's experts' gradients mixed).
        _, vjp = jax.vjp(
            lambda w: jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32),
            vary_like(jnp.zeros(w.shape, x.dtype), x, dy_w, group_sizes),
        )
        return dx, vjp(dy_w.astype(jnp.float32))[0].astype(jnp.float32)
    nt = (((1,), (1,)), ((), ()))
    tn = (((0,), (0,)), ((), ()))
    dx = vary_like(jnp.zeros((dy.shape[0], w.shape[1]), jnp.float32), dy, w, group_sizes)
    dw = vary_like(jnp.zeros(w.shape, jnp.float32), x, dy_w, group_sizes)

    def group(e, each_chunk, carry):
        dx, dw = carry
        wg = jax.lax.dynamic_index_in_dim(w, e, keepdims=False)

        def chunk(c, first, carry):
            dx, acc = carry
            grad = jax.lax.dynamic_slice_in_dim(dy, first, c)
            y = jax.lax.dot_general(grad, wg, nt, preferred_element_type=jnp.float32)
            rows = jax.lax.dynamic_slice_in_dim(x, first, c)
            grad_w = jax.lax.dynamic_slice_in_dim(dy_w, first, c)
            g = jax.lax.dot_general(rows, grad_w, tn, preferred_element_type=jnp.float32)
            return jax.lax.dynamic_update_slice_in_dim(dx, y, first, 0), acc + g

        acc = vary_like(jnp.zeros(w.shape[1:], jnp.float32), x, dy_w, group_sizes)
        dx, acc = each_chunk(chunk, (dx, acc))
        return dx, jax.lax.dynamic_update_index_in_dim(dw, acc, e, 0)

    return _group_loop(tile, x.shape[0], groups, group, (dx, dw))


def _fp8_rows(impl, x, grad: bool = False) -> jax.Array:
    floor = GRAD_AMAX_FLOOR if grad else AMAX_FLOOR
    q = fp8.quantize(x, block=(1, FP8_BLOCK), amax_floor=floor, impl=impl)
    return fp8.dequantize(q, jnp.float32)


def _fp8_split(impl, x, group_sizes, grad: bool = False) -> jax.Array:
    floor = GRAD_AMAX_FLOOR if grad else AMAX_FLOOR
    q = fp8.quantize_split_transpose(x, group_sizes, amax_floor=floor, impl=impl)
    return q.dequantize(jnp.float32)


def _grouped_linear(
    tile: int, quantized: bool | str, impl, x, w, groups, tails: tuple[bool, bool] = (True, True)
) -> jax.Array:
    """The grouped GEMM ``x @ w[group]`` (:func:`_gmm`) with its ``custom_vjp`` (:func:`_gmm_bwd`).

    quantized: False, True (quantize x's rows 1 x 128) or "given" (x: dequantized FP8 rows).
    tails: whether the output's rows after the groups, and x's gradient's, are zeroed (False:
    left unwritten by the custom calls; the caller never reads them).
    """
    return _linear_vjp(tile, quantized, impl, tails, x, w, groups)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _linear_vjp(tile: int, quantized: bool | str, impl, tails, x, w, groups):
    return _linear_fwd(tile, quantized, impl, tails, x, w, groups)[0]


def _fp8_kernel(tile: int, quantized: bool | str, impl, x, w) -> bool:
    """Whether the block-scaled GEMMs of x ``[R, K]`` and w ``[L, K, N]`` run on FP8 tensor cores.

    That is :func:`jaxops._grouped_gemm.grouped_gemm_fp8`'s kernel for the forward and the input
    gradient (w read transposed) and :func:`jaxops._grouped_gemm.grouped_gemm_fp8_wgrad`'s for
    the weight gradient; otherwise the quantized operands are dequantized and the grouped GEMMs
    run in float32.
    """
    if not quantized or not _kernel(tile, impl):
        return False
    shape = (x.shape[0], x.shape[1], w.shape[2], w.shape[0])
    # Preferred where it runs, never required: impl="ffi" asks for jaxops' custom calls, which
    # the dequantized path runs too.
    return _grouped_gemm.fp8_kernel_runs(shape, ("ffi", "xla"), "jaxops.parallel.expert.moe_layer")


def _linear_fwd(tile: int, quantized: bool | str, impl, tails, x, w, groups):
    like = x[:0]  # x's dtype and varying axes, for its cotangent
    if _fp8_kernel(tile, quantized, impl, x, w):
        # FP8 operands into the kernel: x (given rows too: their FP8 values times their scales
        # requantize to themselves) in 1 x 128 groups, w in 128 x 128 tiles (its data
        # transposed by XLA to the kernel's K-major). w itself is the residual (the backward
        # quantizes it again): an FP8 or float32 copy per layer would outlive the forward.
        xq = fp8.quantize(x, block=(1, FP8_BLOCK), impl=impl)
        wq = fp8.quantize(w, block=(FP8_BLOCK, FP8_BLOCK), impl=impl)
        y = _grouped_gemm.grouped_gemm_fp8(xq, wq, groups[0], zero_tail=tails[0], impl=impl)
        saved = x.astype(w.dtype) if quantized == "given" else x
        return y, ((saved, like), w, groups)
    if quantized:
        xq = x if quantized == "given" else _fp8_rows(impl, x)
        # Given rows are float32 (FP8 values times their scales); the wgrad requantizes them,
        # so they are kept in the compute dtype (the weights'), as other inputs are.
        saved = x.astype(w.dtype) if quantized == "given" else x
        w = fp8.dequantize(fp8.quantize(w, block=(FP8_BLOCK, FP8_BLOCK), impl=impl), jnp.float32)
        y = _gmm(tile, xq, w, groups, impl=impl, zero_tail=tails[0])
        return y, ((saved, like), w, groups)
    return _gmm(tile, x, w, groups, impl=impl, zero_tail=tails[0]), ((x, like), w, groups)


def _linear_bwd(tile: int, quantized: bool | str, impl, tails, saved, dy):
    (x, x_like), w, groups = saved
    if _fp8_kernel(tile, quantized, impl, x, w):
        # Both on the FP8 kernels: the dgrad from dy's 1 x 128 groups and w's tiles, whose data
        # [L, K, N] is already K-major for dy @ w[l]ᵀ; the wgrad from the per-expert transposes
        # of x and dy in 128-token groups (the same quantization as below).
        dyq = fp8.quantize(dy, block=(1, FP8_BLOCK), amax_floor=GRAD_AMAX_FLOOR, impl=impl)
        wq = fp8.quantize(w, block=(FP8_BLOCK, FP8_BLOCK), impl=impl)
        w_t = dataclasses.replace(wq, transposed=True)  # logically [L, N, K]
        dx = _grouped_gemm.grouped_gemm_fp8(dyq, w_t, groups[0], zero_tail=tails[1], impl=impl)
        xs = fp8.quantize_split_transpose(x, groups[0], amax_floor=AMAX_FLOOR, impl=impl)
        dys = fp8.quantize_split_transpose(dy, groups[0], amax_floor=GRAD_AMAX_FLOOR, impl=impl)
        dw = _grouped_gemm.grouped_gemm_fp8_wgrad(xs, dys, impl=impl)
        dx = cotangent_like(dx.astype(x_like.dtype), x_like)
        return dx, cotangent_like(dw.astype(w.dtype), w), None
    if quantized:
        # dgrad from 1 x 128 gradient groups and w's tiles read transposed; wgrad from
        # per-expert transposes quantized in 128-token groups (DeepSeek-V3's recipe).
        dyq = _fp8_rows(impl, dy, grad=True)
        xs = _fp8_split(impl, x, groups[0])
        dys = _fp8_split(impl, dy, groups[0], grad=True)
    else:
        dyq = dys = dy.astype(x.dtype)
        xs = x
    dx, dw = _gmm_bwd(tile, dyq, w, xs, dys, groups, impl=impl, dx_zero_tail=tails[1])
    dx = cotangent_like(dx.astype(x_like.dtype), x_like)
    return dx, cotangent_like(dw.astype(w.dtype), w), None


_linear_vjp.defvjp(_linear_fwd, _linear_bwd)


def _groups(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(group_sizes, each group's first row) for :func:`_gmm`."""
    return group_sizes, jnp.cumsum(group_sizes) - group_sizes


def _bias_rows(group_sizes: jax.Array, used: jax.Array, rows: int):
    """(each row's group ``[R]``, whether the row is in use ``[R]``) for :func:`_add_bias`.

    The groups lie back to back from row 0, group l ``group_sizes[l]`` rows (padded) of which
    the first ``used[l]`` hold tokens; the rest of a group and every row after the last group
    are padding.
    """
    ends = jnp.cumsum(group_sizes)
    r = jnp.arange(rows, dtype=jnp.int32)
    group = jnp.searchsorted(ends, r, side="right").astype(jnp.int32)  # L after the groups
    last = group_sizes.shape[0] - 1
    clipped = jnp.minimum(group, last)
    start = ends[clipped] - group_sizes[clipped]
    return clipped, (group <= last) & (r - start < used[clipped])


def _add_bias(y: jax.Array, bias: jax.Array, bias_rows) -> jax.Array:
    """float32 ``y [R, N]`` plus each in-use row's group's ``bias [L, N]`` (padding rows: 0)."""
    group, in_use = bias_rows
    return y + jnp.where(in_use[:, None], bias.astype(jnp.float32)[group], 0.0)


def grouped_ffn(
    cfg: MoEConfig,
    tile: int,
    impl,
    rows,
    w_in,
    w_out,
    group_sizes,
    b_in=None,
    b_out=None,
    used=None,
    tail_read: bool = True,
    adapters=None,
) -> jax.Array:
    """Each group of rows through its expert's FFN: ``[R, H] -> [R, H]`` in cfg.dtype.

    With ``cfg.dispatch == "fp8"`` the rows are the received FP8 tokens, dequantized (float32).
    `tile`: the row tile of the loop (0: ``jax.lax.ragged_dot``); group_sizes: int32 ``[L]``
    (padded). With cfg.expert_bias, b_in ``[L, F']`` and b_out ``[L, H]`` are the local experts'
    biases and used int32 ``[L]`` the rows of each group that hold tokens: only those take their
    expert's biases (float32, after each GEMM), so padding rows stay zero and add nothing to the
    biases' gradients or to an FP8 wgrad's 128-row group scales.

    tail_read=False: the caller reads the output's rows after the groups nowhere, nor what
    becomes of the rows' gradient there (the gather exchange: jaxops' unpermute reads the
    routed rows only, and so does its permute's backward). The output and the rows' gradient
    then leave those rows unwritten too, wherever the intermediates do.

    adapters: with cfg.lora, the local experts' adapters by parameter name
    (``w_in_lora_a [L, H, r]``, ``w_in_lora_b [L, r, F']``, ``w_out_lora_a``, ``w_out_lora_b``):
    each adapted GEMM adds ``scaling * (x @ A) @ B``, two grouped GEMMs of rank r on the same
    rows and groups (in cfg.dtype, float32 accumulation; never FP8).
    """
    groups = _groups(group_sizes)
    quantized = cfg.fp8 == "block"
    first = "given" if cfg.dispatch == "fp8" else quantized
    bias_rows = None if b_in is None else _bias_rows(group_sizes, used, rows.shape[0])
    # The groups' rows only, through custom calls that read nothing else (the activation calls
    # on the first GEMM's output; no FP8 quantization or bias over every row): the intermediates
    # (h, the activation, and their gradients) leave the rows after the groups unwritten.
    grouped = _activation_kernel(cfg, tile, impl, jnp.float32)
    zero = not (grouped and first is False and bias_rows is None) or _checking_floats()
    edge = zero or tail_read  # the output's and the rows' gradient's rows after the groups
    h = _grouped_linear(tile, first, impl, rows, w_in.astype(cfg.dtype), groups, (zero, edge))
    h = _adapt(cfg, tile, impl, adapters, "w_in", h, rows, groups, (zero, edge))
    if bias_rows is not None:
        h = _add_bias(h, b_in, bias_rows)
    if grouped:  # the groups' rows only (the buffer's worst case)
        a = _grouped_activate(cfg, h, group_sizes, zero)
    else:
        a = activate(cfg, h).astype(cfg.dtype)
    w_out = w_out.astype(cfg.dtype)
    out = _grouped_linear(tile, quantized, impl, a, w_out, groups, (edge, zero))
    out = _adapt(cfg, tile, impl, adapters, "w_out", out, a, groups, (edge, zero))
    if bias_rows is not None:
        out = _add_bias(out, b_out, bias_rows)
    return out.astype(cfg.dtype)


def _adapt(cfg: MoEConfig, tile: int, impl, adapters, target: str, y, x, groups, tails):
    """float32 `y` (``x @ W``) plus the target's adapter ``scaling * (x @ A) @ B``, if any."""
    if cfg.lora is None or target not in cfg.lora.targets:
        return y
    dt = cfg.dtype
    a, b = adapters[f"{target}_lora_a"].astype(dt), adapters[f"{target}_lora_b"].astype(dt)
    t = _grouped_linear(tile, False, impl, x.astype(dt), a, groups, tails)
    d = _grouped_linear(tile, False, impl, t.astype(dt), b, groups, tails)
    return y + cfg.lora.scaling * d


def _linear(cfg: MoEConfig, impl, a: jax.Array, w: jax.Array) -> jax.Array:
    """``a @ w`` as float32: a dense GEMM, or with cfg.fp8 the block-scaled fp8.linear."""
    if cfg.fp8 == "block":
        return fp8.linear(a, w, impl=impl).astype(jnp.float32)
    return jnp.dot(a, w, preferred_element_type=jnp.float32)


def _dense_adapt(cfg: MoEConfig, adapters, target: str, y: jax.Array, x: jax.Array) -> jax.Array:
    """float32 `y` (``x @ W``) plus the target's adapter ``scaling * (x @ A) @ B``, if any."""
    if not adapters or cfg.lora is None or target not in cfg.lora.targets:
        return y
    dt = cfg.dtype
    a, b = adapters[f"{target}_lora_a"].astype(dt), adapters[f"{target}_lora_b"].astype(dt)
    t = jnp.dot(x.astype(dt), a, preferred_element_type=jnp.float32).astype(dt)
    return y + cfg.lora.scaling * jnp.dot(t, b, preferred_element_type=jnp.float32)


def expert_ffn(
    cfg: MoEConfig,
    xs: jax.Array,
    w_in: jax.Array,
    w_out: jax.Array,
    impl: str | None = None,
    b_in: jax.Array | None = None,
    b_out: jax.Array | None = None,
    adapters: dict[str, jax.Array] | None = None,
) -> jax.Array:
    """One dense FFN ``act(xs @ w_in + b_in) @ w_out + b_out``, float32 ``[T, H]``.

    xs, w_in, w_out in cfg.dtype; GEMMs accumulate in float32 (with cfg.fp8 the block-scaled
    ``jaxops.fp8.linear``, its output in cfg.dtype). The biases (None: none), ``b_in [F']`` and
    ``b_out [H]``, are added in float32 to the GEMMs' outputs. The activation's input is float32.
    impl="xla" runs fp8.linear's pure-JAX twin; otherwise its default (its GEMMs have no CPU
    kernel, so "ffi" is not forced on it). adapters: this expert's LoRA factors by parameter
    name (``w_in_lora_a [H, r]``, ...), each adapted GEMM adding ``scaling * (x @ A) @ B`` in
    float32 (``x @ A`` rounded to cfg.dtype), as :func:`grouped_ffn` does.
    """
    hid = _dense_adapt(cfg, adapters, "w_in", _linear(cfg, impl, xs, w_in), xs)
    if b_in is not None:
        hid = hid + b_in.astype(jnp.float32)
    act = activate(cfg, hid).astype(cfg.dtype)
    out = _dense_adapt(cfg, adapters, "w_out", _linear(cfg, impl, act, w_out), act)
    if b_out is not None:
        out = out + b_out.astype(jnp.float32)
    return out


def shared_expert(
    cfg: MoEConfig, params, tokens: jax.Array, impl: str | None = None
) -> jax.Array | None:
    """The shared expert on every token, float32 ``[T, H]`` (None without one).

    Its projections are dense GEMMs in cfg.dtype with float32 accumulation (with cfg.fp8 the
    block-scaled ``jaxops.fp8.linear``); the optional sigmoid gate is computed in float32.
    """
    if not cfg.shared_ffn:
        return None
    xs = tokens.astype(cfg.dtype)
    w_in = params["shared_w_in"].astype(cfg.dtype)
    w_out = params["shared_w_out"].astype(cfg.dtype)
    if cfg.fp8 == "block":
        # Inside shard_map the weights are replicated and the tokens vary: mark the weights
        # varying so fp8.linear's backward (a per-device weight gradient) types check; the
        # cast's transpose sums the gradient over the devices.
        w_in, w_out = vary_like((w_in, w_out), xs)
    targets = () if cfg.lora is None else cfg.lora.targets
    if any(t.startswith("shared_") for t in targets):  # gate and up adapted apart
        hid = _linear(cfg, impl, xs, w_in)
        f = cfg.shared_ffn
        gate = _dense_adapt(cfg, params, "shared_gate_proj", hid[..., :f], xs)
        up = _dense_adapt(cfg, params, "shared_up_proj", hid[..., f:], xs)
        act = activate(cfg, jnp.concatenate([gate, up], axis=-1)).astype(cfg.dtype)
        out = _dense_adapt(cfg, params, "shared_down_proj", _linear(cfg, impl, act, w_out), act)
    else:
        out = expert_ffn(cfg, xs, w_in, w_out, impl)
    if cfg.shared_gate:
        gate = jnp.dot(
            tokens.astype(jnp.float32),
            params["shared_gate"].astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        out = jax.nn.sigmoid(gate) * out
    return out
