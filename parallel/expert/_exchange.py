"""The exchange along the expert axis: static bounds, the plan, offsets, ragged / dense / FP8.

:func:`exchange_bounds` and :func:`make_plan` fix the static buffer sizes, the exchange (these
all-to-all forms, or :mod:`._gather`'s all-gather) and the kernel choices;
:func:`offsets` turns the all-gathered ``[N, E]`` counts into every device's send and receive
offsets; :func:`exchange` runs one all-to-all exchange (``jax.lax.ragged_all_to_all``, or its
exact dense twin :func:`ragged_all_to_all_dense`, the plan's kind); :func:`fp8_dispatch` moves
FP8 rows and their scales (the gradient crossing back in the compute dtype).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxops import _grouped_gemm, fp8
from jaxops._moe import unpermute_rows
from jaxops._moe.layout import permuted_rows
from jaxops._rows import round_up, take_rows
from jaxops._sharding import cotangent_like, vary_like, varying_axes

from ._config import FP8_BLOCK, MoEConfig
from ._ffn import CPU_TILE, GPU_TILE, _kernel

__all__ = [
    "Plan",
    "exchange",
    "exchange_bounds",
    "fp8_dispatch",
    "make_plan",
    "offsets",
    "ragged_all_to_all_dense",
    "ragged_dot_bytes",
]


def _exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def _slice_of_row(sizes: jax.Array, pos: jax.Array):
    """Which slice each position belongs to, for slices packed back to back.

    sizes: ``[n, L]``; pos: int32 ``[B]`` positions in each of the n packed sequences. Returns
    (slice index, its start position, position in use), each ``[n, B]``.
    """
    ends = jnp.cumsum(sizes, axis=1)
    idx = jax.vmap(lambda e: jnp.searchsorted(e, pos, side="right"))(ends).astype(jnp.int32)
    valid = idx < sizes.shape[1]
    idx = jnp.minimum(idx, sizes.shape[1] - 1)
    start = jnp.take_along_axis(ends - sizes, idx, axis=1)
    return idx, start, valid


def _one_round(
    operand, output, input_offsets, send_sizes, recv_offsets, recv_sizes, first, *, axis_name, block
):
    """Positions ``first .. first + block - 1`` of every peer's packed slices, exchanged.

    The offsets and sizes are ``[n, L]``; `recv_offsets` is where each sender's slice starts in
    `output`. One dense all_to_all moves the ``[n, block, ...]`` blocks and the receiver scatters
    the rows in use.
    """
    n = send_sizes.shape[0]
    pos = first + jnp.arange(block, dtype=jnp.int32)
    idx, start, valid = _slice_of_row(send_sizes, pos)
    src = jnp.take_along_axis(input_offsets, idx, axis=1) + pos - start
    packed = take_rows(operand, src, valid)
    received = jax.lax.all_to_all(packed, axis_name, 0, 0, tiled=False)
    idx, start, valid = _slice_of_row(recv_sizes, pos)
    dst = jnp.take_along_axis(recv_offsets, idx, axis=1) + pos - start
    dst = jnp.where(valid, dst, output.shape[0])  # out of range: dropped by the scatter
    return output.at[dst.reshape(-1)].set(
        received.reshape(n * block, *operand.shape[1:]), mode="drop"
    )


def _rounds_loop(
    operand,
    output,
    input_offsets,
    send_sizes,
    recv_offsets,
    recv_sizes,
    rounds,
    *,
    axis_name,
    block,
):
    """`rounds` (traced, the same on every device) rounds of :func:`_one_round`."""
    # The carry varies like the rows it receives from the first round on.
    output = vary_like(output, operand, input_offsets, recv_offsets)
    if axis_name not in varying_axes(output):
        output = jax.lax.pcast(output, (axis_name,), to="varying")

    def body(r, out):
        sizes = (input_offsets, send_sizes, recv_offsets, recv_sizes)
        return _one_round(operand, out, *sizes, r * block, axis_name=axis_name, block=block)

    return jax.lax.fori_loop(0, rounds, body, output)


def _written(recv_offsets, recv_sizes, rows: int) -> jax.Array:
    """The output rows the exchange writes (bool ``[rows]``): any received slice covers them."""
    starts = recv_offsets.reshape(-1)
    ends = starts + recv_sizes.reshape(-1)
    marks = jnp.zeros(rows + 1, jnp.int32)
    marks = marks.at[starts].add(1, mode="drop").at[ends].add(-1, mode="drop")
    return jnp.cumsum(marks)[:rows] > 0


def _in_rounds(*args, axis_name, block):
    """:func:`_rounds_loop` of `args`; its backward is its transpose, the same rounds back.

    A loop of data-dependent length has no reverse-mode rule of its own.
    """
    loop = functools.partial(_rounds_loop, axis_name=axis_name, block=block)
    op_shape, out_rows = args[0].shape, args[1].shape[0]
    run = jax.custom_vjp(loop)

    def fwd(operand, output, *ints):
        return run(operand, output, *ints), (ints, operand[:0], output[:0])

    def bwd(saved, d_out):
        (input_offsets, send_sizes, recv_offsets, recv_sizes, rounds), op0, out0 = saved
        back = jnp.zeros(op_shape, d_out.dtype)
        # Every slice returns from where it landed to where it was taken from.
        d_operand = loop(d_out, back, recv_offsets, recv_sizes, input_offsets, send_sizes, rounds)
        written = _written(recv_offsets, recv_sizes, out_rows)
        mask = written.reshape(written.shape + (1,) * (d_out.ndim - 1))
        d_output = jnp.where(mask, jnp.zeros((), d_out.dtype), d_out)
        d_operand = cotangent_like(d_operand.astype(op0.dtype), op0)
        return (d_operand, cotangent_like(d_output.astype(out0.dtype), out0), *[None] * 5)

    run.defvjp(fwd, bwd)
    return run(*args)


def ragged_all_to_all_dense(
    operand,
    output,
    input_offsets,
    send_sizes,
    output_offsets,
    recv_sizes,
    *,
    axis_name,
    chunk,
    recv_offsets=None,
    block=None,
    rounds=None,
):
    """``jax.lax.ragged_all_to_all``'s semantics from dense all_to_alls (for XLA:CPU).

    Same arguments (``L = len(input_offsets) / axis size`` slices per peer); `chunk` (static)
    bounds the rows one device sends another. Each device packs the slices for peer j back to
    back; a round moves positions ``r * block .. (r + 1) * block - 1`` of every peer's packed
    rows as one all_to_all of ``[n, block, ...]`` blocks, and the receiver scatters each row to
    ``output_offsets + position`` in its slice, the senders' `output_offsets` for it: a second
    all_to_all brings them, unless `recv_offsets` gives them (int32 ``[n * L]``: sender i's slice
    l starts at ``recv_offsets[i * L + l]`` of `output`; the layer knows them from the
    all-gathered counts, so its exchanges are one collective a round).

    `block` (static, default `chunk`): rows per peer in one round. With ``block >= chunk`` one
    round moves every row (the worst case's ``n * chunk`` rows each way, whatever the routing).
    A smaller block sends ``ceil(max rows one device sends another / block)`` rounds in a loop:
    the buffers are ``n * block`` rows, not ``n * chunk``, and a round trip is as long as the
    largest transfer needs. `rounds` (int32 scalar, the same on every device) is that count; by
    default one ``pmax`` over `axis_name` finds it. In rounds the gradient is the exchange's
    transpose (a ``custom_vjp``: the same rounds, back). Rows beyond `chunk` would be lost:
    callers size it with :func:`exchange_bounds`.
    """
    n = jax.lax.axis_size(axis_name)
    slices = input_offsets.shape[0] // n
    in_off = input_offsets.reshape(n, slices)
    send = send_sizes.reshape(n, slices)
    recv = recv_sizes.reshape(n, slices)
    if recv_offsets is None:
        their = jax.lax.all_to_all(output_offsets.reshape(n, slices), axis_name, 0, 0, tiled=False)
    else:
        their = recv_offsets.reshape(n, slices)
    block = chunk if block is None else max(1, min(block, chunk))
    if block >= chunk:
        zero = jnp.zeros((), jnp.int32)
        return _one_round(
            operand, output, in_off, send, their, recv, zero, axis_name=axis_name, block=chunk
        )
    if rounds is None:
        most = jax.lax.pmax(jnp.max(jnp.sum(send, axis=1)), axis_name)
        rounds = (most + block - 1) // block
    rounds = jnp.asarray(rounds, jnp.int32)
    return _in_rounds(
        operand, output, in_off, send, their, recv, rounds, axis_name=axis_name, block=block
    )


def exchange_bounds(
    cfg: MoEConfig,
    tokens_per_device: int,
    expert_axis_size: int,
    num_tokens: int | None = None,
    *,
    align: int | None = None,
) -> tuple[int, int]:
    """``(chunk, recv_rows)``: the static bounds of the exchange (see the package docstring).

    `num_tokens` is the global batch (for the capacity); default ``tokens_per_device`` times the
    expert axis size. `align` is the receiver's group alignment (default cfg.align; on a GPU, and
    off GPU with ``impl="xla"``, the layer uses ``lcm(cfg.align, tile)`` for its row-tiled
    grouped GEMM).

    Example:
      >>> from jaxops.parallel.expert import MoEConfig, exchange_bounds
      >>> cfg = MoEConfig(num_experts=64, top_k=8, hidden_size=1024, expert_ffn=512, align=16)
      >>> exchange_bounds(cfg, tokens_per_device=4096, expert_axis_size=8)
      (32768, 262264)
    """
    n, tl = expert_axis_size, tokens_per_device
    align = cfg.align if align is None else align
    local = cfg.num_experts // n
    num_tokens = tl * n if num_tokens is None else num_tokens
    chunk = tl * min(cfg.top_k, local)
    recv = n * chunk + local * (align - 1)
    c = cfg.capacity(num_tokens)
    if c is not None:
        chunk = min(chunk, local * min(c, tl))
        recv = min(recv, local * round_up(min(c, n * tl), align))
    return max(chunk, 1), max(recv, 1)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static sizes and kernel choices of one layer call."""

    n: int  # expert axis size
    local: int  # experts per device
    num_tokens: int  # global T
    capacity: int | None
    chunk: int  # dense form: rows one device sends another (bound)
    block: int  # dense form: rows per peer in one round (chunk: a single round)
    recv_rows: int  # rows of the grouped FFN's buffer
    kind: str  # "ragged" (ragged_all_to_all), "dense" (its dense form) or "gather"
    align: int  # receiver's group alignment
    tile: int  # row tile of the grouped GEMM loop; 0: jax.lax.ragged_dot


def _platform(mesh: Any) -> str:
    devices = getattr(mesh, "devices", None)
    if devices is not None and devices.size:
        return devices.flat[0].platform
    return jax.default_backend()


#: On GPU without jaxops' CUDA grouped GEMM, the bytes of the float32 ``[L, R, K]`` operand up
#: to which the grouped GEMMs are ``jax.lax.ragged_dot``. XLA:GPU lowers a ragged_dot with L
#: groups to a dense dot over all of them (that masked operand, L times the FLOPs): Qwen3-MoE's
#: 128 experts over 4 x 2048 tokens asked for 129 GiB on an H200 and failed to compile. Past
#: this size (with L > 1; one group is a plain dot) the groups run the loop of :mod:`._ffn`
#: instead: one GEMM per chunk of a group's rows, groups padded to ``GPU_TILE`` rows. Each trip
#: of that loop costs tens of us on a GPU, so it wins only where the dense form is huge.
#: Measured on an H200 (bench_expert_parallel, fwd+bwd): 128 local experts, 8192 x top-8
#: tokens (a 64 GiB operand): the loop 70 ms, the dense masked layer 297 ms; 16 experts,
#: 8192 x top-2, H 1024 (0.5 GiB): the loop's forward 5.0 ms against the dense layer's 0.64 ms.
GPU_RAGGED_DOT_MAX_BYTES = 4 << 30


def ragged_dot_bytes(cfg: MoEConfig, local: int, rows: int) -> int:
    """Bytes of the widest masked operand of XLA:GPU's dense form of ragged_dot.

    That operand is float32 ``[local, rows, K]``, K the widest contracting size of the expert
    FFN's GEMMs and their gradients (the hidden size, or the first projection's output width).
    """
    width = max(cfg.hidden_size, cfg.w_in_width)
    return 4 * local * rows * width


#: The dense exchange's rows per peer in one round, as a multiple of the mean (a device sends
#: ``Tl * K / N`` rows to each peer on average): one round while no device sends a peer more
#: than 1.25x the mean, a second one for the rest under skewed routing.
DENSE_BLOCK_SLACK = 1.25


def dense_block(cfg: MoEConfig, tokens_per_device: int, n: int, chunk: int) -> int:
    """Rows per peer in one round of the dense exchange (:func:`ragged_all_to_all_dense`).

    ``DENSE_BLOCK_SLACK`` times the mean ``Tl * K / N``, rounded up to 8 rows, at most `chunk`
    (the bound of one peer's rows, where a single round moves everything).

    Example:
      >>> from jaxops.parallel.expert import MoEConfig
      >>> from jaxops.parallel.expert._exchange import dense_block
      >>> cfg = MoEConfig(num_experts=256, top_k=8, hidden_size=7168, expert_ffn=2048)
      >>> dense_block(cfg, tokens_per_device=4096, n=256, chunk=4096)
      160
    """
    mean = tokens_per_device * cfg.top_k / n
    return max(1, min(chunk, round_up(math.ceil(DENSE_BLOCK_SLACK * mean), 8)))


def make_plan(
    cfg: MoEConfig, mesh: Any, n: int, shards: int, num_tokens: int, impl: str | None = None
) -> Plan:
    """Static buffer sizes and kernel choices for `num_tokens` tokens in all.

    `n`: the expert axis size; `shards`: the devices on the token axes; `impl`: the layer's (the
    group alignment depends on it off GPU).
    """
    gpu = _platform(mesh) == "gpu"
    tl, local, capacity = num_tokens // shards, cfg.num_experts // n, cfg.capacity(num_tokens)
    tile = CPU_TILE
    if gpu and local == 1:
        tile = 0  # one group: ragged_dot is a plain dot
    elif gpu and not _grouped_gemm.kernel_available("gpu"):
        _, rows = exchange_bounds(cfg, tl, n, num_tokens, align=cfg.align)
        small = ragged_dot_bytes(cfg, local, rows) <= GPU_RAGGED_DOT_MAX_BYTES
        tile = 0 if small else GPU_TILE
    elif gpu:
        tile = GPU_TILE  # jaxops' CUDA grouped GEMM (the loop with impl="xla")
    align = math.lcm(cfg.align, tile) if tile else cfg.align
    if not gpu and _kernel(tile, impl):
        # The CPU custom calls take groups of any size; only their loop twin (impl "xla") cuts
        # groups into tiles. Fewer GEMM rows: on 2 x 4 CPU devices, 4 local experts of 16, about
        # 526 rows in groups padded to the default align of 8 against 574 padded to 32 (a train
        # step of bench_models' 4x256x16x2x256 decoder 2.5% faster).
        align = cfg.align
    chunk, recv_rows = exchange_bounds(cfg, tl, n, num_tokens, align=align)
    kind = cfg.exchange
    if kind == "auto":
        # Off GPU (no ragged all-to-all) the gather moves N * Tl rows, the dense form N * block
        # rows a round, but it packs, loops and scatters: on 2 x 4 CPU devices (16 experts,
        # top-2: 160 rows a peer a round against 256 gathered) the decoder's train step took
        # 1.10x as long with it. The gather unless a small capacity makes chunk < Tl.
        kind = "ragged" if gpu else "gather" if chunk >= tl else "dense"
    if kind == "gather":
        recv_rows = permuted_rows(n * tl, cfg.top_k, local, align, capacity)
    return Plan(
        n=n,
        local=local,
        num_tokens=num_tokens,
        capacity=capacity,
        chunk=chunk,
        block=dense_block(cfg, tl, n, chunk),
        recv_rows=max(recv_rows, 1),
        kind=kind,
        align=align,
        tile=tile,
    )


def exchange(plan: Plan, axis: str, operand, output, offsets):
    """One exchange of plan.kind "ragged" (ragged_all_to_all) or "dense" (its dense form).

    `offsets`: :func:`offsets`' forward or backward tuple (ragged_all_to_all's four arguments,
    then the receiver's view of the senders' output offsets, which the dense form uses instead
    of exchanging them, and the dense form's number of rounds).
    """
    *ragged, recv_offsets, rounds = offsets
    if plan.kind == "ragged":
        # ragged_all_to_all types its result like `output` alone: a zero buffer is invariant,
        # and the rows received into it, which differ on every device, would have their
        # cotangents summed over the mesh in the backward. It varies like the rows sent, and
        # over the exchange's axis.
        output = vary_like(output, operand, *ragged)
        if axis not in varying_axes(output):
            output = jax.lax.pcast(output, (axis,), to="varying")
        return jax.lax.ragged_all_to_all(operand, output, *ragged, axis_name=axis)
    return ragged_all_to_all_dense(
        operand,
        output,
        *ragged,
        axis_name=axis,
        chunk=plan.chunk,
        recv_offsets=recv_offsets,
        block=plan.block,
        rounds=rounds,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def fp8_dispatch(plan: Plan, axis: str, impl, tokens, data, scales, row_map, offsets):
    """The FP8 dispatch: permuted FP8 rows and their scales exchanged, dequantized (float32).

    tokens: ``[T, H]`` in the compute dtype, only for the gradient (straight through the
    quantization); data / scales: the sender's permuted FP8 rows ``[R, H]`` and float32 scales
    ``[R, H / 128]``; row_map: the permute's ``[T, K]`` rows; offsets: (forward, backward)
    exchange arguments. Forward: two exchanges (FP8 payload, scale payload). Backward: the
    rows' gradient crosses back in the compute dtype and each token sums its K rows' gradients.
    """
    return _fp8_dispatch_fwd(plan, axis, impl, tokens, data, scales, row_map, offsets)[0]


def _fp8_dispatch_fwd(plan: Plan, axis: str, impl, tokens, data, scales, row_map, offsets):
    forward, backward = offsets
    h = data.shape[1]
    # The FP8 bytes cross as uint8: XLA:CPU would otherwise widen a float8 collective to f16.
    payload = jax.lax.bitcast_convert_type(data, jnp.uint8)
    rows = exchange(plan, axis, payload, jnp.zeros((plan.recv_rows, h), jnp.uint8), forward)
    rows = jax.lax.bitcast_convert_type(rows, data.dtype)
    shape = (plan.recv_rows, scales.shape[1])
    row_scales = exchange(plan, axis, scales, jnp.zeros(shape, jnp.float32), forward)
    out = fp8.dequantize(fp8.QuantizedArray(rows, row_scales, (1, FP8_BLOCK)), jnp.float32)
    # The permuted buffer's rows, as the shape of an empty array (residuals are arrays).
    sent = tokens[:0, :1].reshape(0)
    sent = jnp.broadcast_to(sent[:, None], (0, data.shape[0]))
    return out, (row_map, backward, sent, tokens[:0])


def _fp8_dispatch_bwd(plan: Plan, axis: str, impl, saved, d_rows):
    row_map, backward, sent, like = saved
    d_rows = d_rows.astype(like.dtype)
    back = jnp.zeros((sent.shape[1], d_rows.shape[1]), like.dtype)
    d_sent = exchange(plan, axis, d_rows, back, backward)
    # The permute's own backward: each token sums the gradients of its K rows.
    d_tokens = unpermute_rows(d_sent, row_map, None, impl)
    return cotangent_like(d_tokens.astype(like.dtype), like), None, None, None, None


fp8_dispatch.defvjp(_fp8_dispatch_fwd, _fp8_dispatch_bwd)


def offsets(plan: Plan, align: int, me, counts_all, kept_all):
    """Forward and backward exchange arguments and the receiver's group sizes.

    counts_all / kept_all: int32 ``[N, E]``, every expert-axis peer's routed and kept slots per
    expert. G[i, j, l] = rows peer i sends to peer j's local expert l.

    Returns:
      ``(forward, backward, group_sizes, used)``: the two exchanges' arguments (those of
      ``jax.lax.ragged_all_to_all``, then where each sender's slices land in this device's
      output: every peer's offsets follow from the all-gathered counts; then the dense form's
      rounds, ``ceil(max rows one device sends another / plan.block)``, the same on every
      device and for both directions), this device's
      int32 ``[L]`` group sizes padded to `align`, and the rows of each group that hold tokens
      (the first ``used[l]`` of group l; the backward exchange returns exactly those, so the
      padding rows after them, and after the last group, are never read back).
    """
    n, lx = plan.n, plan.local
    g = kept_all.reshape(n, n, lx)
    # Sender i's permuted buffer (align 1): expert groups in order, dropped slots at group ends.
    send_base = _exclusive_cumsum(counts_all, axis=1).reshape(n, n, lx)
    # Receiver j: local expert l's group starts at base[j, l]; within it, sender i's rows.
    totals = jnp.sum(g, axis=0)  # [j, l]
    padded = (totals + align - 1) // align * align
    base = _exclusive_cumsum(padded, axis=1)
    recv_at = base[None] + _exclusive_cumsum(g, axis=0)  # [i, j, l]
    most = jnp.max(jnp.sum(g, axis=2))  # the largest transfer, one way or back
    rounds = ((most + plan.block - 1) // plan.block).astype(jnp.int32)
    forward = (
        send_base[me].reshape(-1),
        g[me].reshape(-1),
        recv_at[me].reshape(-1),
        g[:, me].reshape(-1),
        recv_at[:, me].reshape(-1),  # sender i's rows for my expert l land at recv_at[i, me, l]
        rounds,
    )
    backward = (
        recv_at[:, me].reshape(-1),
        g[:, me].reshape(-1),
        send_base[:, me].reshape(-1),
        g[me].reshape(-1),
        send_base[me].reshape(-1),  # expert device i's rows return to send_base[me, i, l]
        rounds,
    )
    return forward, backward, padded[me], totals[me]
