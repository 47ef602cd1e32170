"""The expert-parallel layer: argument checks, the per-device body, moe_layer, the stage probe.

:func:`moe_layer` checks its arguments, plans the exchange and runs :func:`local_layer` in one
``shard_map`` (or directly, inside an enclosing ``shard_map`` over cfg's token axes).
:func:`stage_probe` cuts the layer after one of :data:`STAGES` for the benchmark's time split.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxops import _checks, _ffi, fp8
from jaxops import moe as _moe
from jaxops._config import ImplChoice
from jaxops._errors import ArgumentTypeError, InvalidArgumentError
from jaxops._sharding import manual_axes, place

from ._config import (
    EXPERT_PARAMS,
    FP8_BLOCK,
    MoEAux,
    MoEConfig,
    check_params,
    moe_param_specs,
)
from ._exchange import Plan, exchange, fp8_dispatch, make_plan, offsets
from ._ffn import grouped_ffn, shared_expert
from ._gather import (
    drop_beyond_capacity,
    fp8_gather,
    gather_routing,
    local_ids,
    round_cotangent,
)
from ._routing import (
    aux_from_sums,
    check_token_mask,
    mask_tokens,
    route,
    router_sums,
    slot_counts,
)

__all__ = ["STAGES", "local_layer", "moe_layer", "stage_probe"]

_PREFIX = "jaxops.parallel.expert"

#: The layer's stages, in order (the benchmark's time split).
STAGES = ("router", "permute", "exchange", "ffn", "combine")


def _probe(*values) -> jax.Array:
    """One float32 per device that depends on every value (the benchmark's stage cut)."""
    return sum(jnp.sum(v.astype(jnp.float32)) for v in values).reshape(1)


def _route_and_count(cfg: MoEConfig, plan: Plan, params, tokens, valid=None):
    """(ids, probs, counts, kept, aux): routing, this device's kept slots, global MoEAux.

    valid: None or bool ``[T]``; masked-out tokens take no slot and leave the aux sums out, and
    the losses are means over the unmasked tokens of all shards.
    """
    e, token_axes = cfg.num_experts, cfg.token_axes
    bias, logit_bias = params.get("router_bias"), params.get("router_logit_bias")
    logits, dist, ids, probs = route(cfg, tokens, params["router"], bias, valid, logit_bias, params)
    counts = slot_counts(ids, e, masked=valid is not None)
    if plan.capacity is None:
        kept = counts
    else:
        before = jax.lax.all_gather(counts, token_axes)  # [shards, E], global token order
        me_global = jax.lax.axis_index(token_axes)
        mask = (jnp.arange(before.shape[0]) < me_global)[:, None]
        prefix = jnp.sum(jnp.where(mask, before, 0), axis=0)
        kept = jnp.clip(plan.capacity - prefix, 0, counts)
    sums = [counts, *router_sums(logits, dist, valid), jnp.sum(counts - kept)]
    if valid is not None:  # the global number of unmasked tokens, summed with the rest
        sums.append(jnp.sum(valid, dtype=jnp.int32))
    stats = jax.lax.psum(tuple(sums), token_axes)
    num_tokens = plan.num_tokens if valid is None else stats[4]
    return ids, probs, counts, kept, aux_from_sums(cfg, *stats[:4], num_tokens)


def local_layer(
    cfg: MoEConfig, plan: Plan, impl, params, x, token_mask=None, upto: str = "combine"
):
    """The per-device body of :func:`moe_layer` (inside shard_map): ``(y, aux)``.

    With `upto` before "combine" it stops after that stage and returns :func:`_probe` of the
    stage's results (for the benchmark's time split). token_mask: None or this device's bool
    ``x.shape[:-1]`` (checked).
    """
    h = x.shape[-1]
    valid = None if token_mask is None else token_mask.reshape(-1)
    tokens = mask_tokens(x.reshape(-1, h), valid)
    ids, probs, counts, kept, aux = _route_and_count(cfg, plan, params, tokens, valid)
    if upto == "router":
        return _probe(probs, aux.loss, kept)

    compute = tokens.astype(cfg.dtype)
    if plan.kind == "gather" and not _direct(cfg, plan):
        y = _gathered(cfg, plan, impl, params, compute, ids, probs, kept, upto)
    else:
        y = _exchanged(cfg, plan, impl, params, compute, ids, probs, counts, kept, upto)
    if upto != "combine":  # the stage's values
        return _probe(probs, aux.loss, *y)
    shared = shared_expert(cfg, params, tokens, impl)
    if shared is not None:
        y = y.astype(jnp.float32) + shared
    if valid is not None:  # the shared expert's output too
        y = jnp.where(valid[:, None], y, 0)
    return y.astype(x.dtype).reshape(x.shape), aux


def _direct(cfg: MoEConfig, plan: Plan) -> bool:
    """One device on the expert axis, no capacity: nothing to exchange.

    Permuted with the receiver's alignment, the buffer is already the layout the exchange would
    make (each expert's group padded to plan.align, in slot order), so no exchange runs.
    """
    return plan.n == 1 and plan.capacity is None and cfg.dispatch != "fp8"


def _exchanged(cfg: MoEConfig, plan: Plan, impl, params, compute, ids, probs, counts, kept, upto):
    """Permute, the all-to-all exchange (ragged or dense), the FFN, back, unpermute: ``[T, H]``.

    Before the last stage (`upto`) it returns that stage's values, for :func:`_probe`.
    """
    h, e, axis = compute.shape[1], cfg.num_experts, cfg.expert_axis
    direct = _direct(cfg, plan)
    if cfg.dispatch == "fp8":
        # The sender quantizes once; the FP8 rows move with their scales (no gradient here:
        # fp8_dispatch passes it straight through to the tokens).
        q = fp8.quantize(jax.lax.stop_gradient(compute), block=(1, FP8_BLOCK), impl=impl)
        permuted = _moe.permute(q.data, ids, e, scales=q.scale, impl=impl)
    else:
        # weight_inputs (Llama 4): permute carries each row's weight along (differentiable: the
        # router's gradient comes back through it), and the row is scaled by it in float32 and
        # rounded once before it is sent.
        weights = probs if cfg.weight_inputs else None
        align = plan.align if direct else 1
        permuted = _moe.permute(compute, ids, e, probs=weights, align=align, impl=impl)
    sent = permuted.tokens
    if cfg.weight_inputs:
        sent = (sent.astype(jnp.float32) * permuted.probs[:, None]).astype(cfg.dtype)
    if upto == "permute":
        return (kept, sent)
    if direct:
        rows = jnp.pad(sent, ((0, plan.recv_rows - sent.shape[0]), (0, 0)))
        group_sizes, used = permuted.group_sizes, counts
    else:
        both = jax.lax.all_gather(jnp.stack([counts, kept]), axis)  # [N, 2, E]
        me = jax.lax.axis_index(axis)
        forward, backward, group_sizes, used = offsets(plan, plan.align, me, both[:, 0], both[:, 1])
        if cfg.dispatch == "fp8":
            rows = fp8_dispatch(
                plan,
                axis,
                impl,
                compute,
                permuted.tokens,
                permuted.scales,
                permuted.row_map,
                (forward, backward),
            )
        else:
            recv = jnp.zeros((plan.recv_rows, h), cfg.dtype)
            rows = exchange(plan, axis, sent, recv, forward)
    if upto == "exchange":
        return (rows,)
    out = _ffn(cfg, plan, impl, params, rows, group_sizes, used)
    if upto == "ffn":
        return (out,)
    if direct:
        returned = out[: sent.shape[0]]
    else:
        back = jnp.zeros((permuted.tokens.shape[0], h), cfg.dtype)
        returned = exchange(plan, axis, out, back, backward)
    # weight_inputs: the weights went in with the rows; the outputs are summed unweighted.
    return _moe.unpermute(returned, permuted, probs=None if cfg.weight_inputs else probs, impl=impl)


def _gathered(cfg: MoEConfig, plan: Plan, impl, params, compute, ids, probs, kept, upto):
    """The gather exchange (:mod:`._gather`): ``[T, H]`` float32, or a stage's values."""
    axis, local = cfg.expert_axis, plan.local
    if plan.capacity is not None:  # the sender's slots beyond the capacity cross unused
        ids = drop_beyond_capacity(ids, kept)
    all_ids, all_probs = gather_routing(axis, ids, probs)
    mine = local_ids(all_ids, jax.lax.axis_index(axis), local)
    if upto == "permute":
        return (kept, all_probs)
    if cfg.dispatch == "fp8":
        everyone = fp8_gather(axis, impl, compute)  # dequantized float32
    else:
        everyone = jax.lax.all_gather(compute, axis, tiled=True)
    weights = all_probs if cfg.weight_inputs else None
    # The capacity bounds the buffer only: the senders kept at most C slots per expert in all.
    permuted = _moe.permute(
        everyone, mine, local, probs=weights, align=plan.align, capacity=plan.capacity, impl=impl
    )
    rows = permuted.tokens
    if cfg.dispatch == "fp8":  # float32 rows: their gradient rounded as cfg.dtype rows' is
        rows = round_cotangent(rows, cfg.dtype)
    if cfg.weight_inputs:  # as the all-to-all forms scale a row before it is sent
        rows = (rows.astype(jnp.float32) * permuted.probs[:, None]).astype(cfg.dtype)
    rows = jnp.pad(rows, ((0, plan.recv_rows - rows.shape[0]), (0, 0)))
    if upto == "exchange":
        return (rows,)
    used = slot_counts(mine, local, masked=True)
    # jaxops' unpermute reads the routed rows only, and so does its permute's backward: the FFN
    # may leave its output's and the rows' gradient's rows after the groups unwritten (not for
    # the stage probe, which reads every row).
    tail_read = upto == "ffn" or not _ffi.use_kernel(impl, "jaxops.parallel.expert.moe_layer")
    out = _ffn(cfg, plan, impl, params, rows, permuted.group_sizes, used, tail_read)
    if upto == "ffn":
        return (out,)
    # Each token's outputs from this device's experts (rounded to cfg.dtype, as the rows the
    # other exchanges send back), weighted and summed in float32; the reduce-scatter adds the
    # other devices' parts and returns this device's tokens.
    out = out[: permuted.tokens.shape[0]].astype(cfg.dtype).astype(jnp.float32)
    part = _moe.unpermute(out, permuted, probs=None if cfg.weight_inputs else all_probs, impl=impl)
    return jax.lax.psum_scatter(part, axis, scatter_dimension=0, tiled=True)


def _ffn(cfg: MoEConfig, plan: Plan, impl, params, rows, group_sizes, used, tail_read=True):
    return grouped_ffn(
        cfg,
        plan.tile,
        impl,
        rows,
        params["w_in"],
        params["w_out"],
        group_sizes,
        params.get("b_in"),
        params.get("b_out"),
        used,
        tail_read,
        {name: params[name] for name in cfg.adapter_names if name in EXPERT_PARAMS},
    )


def _check_mesh(op: str, mesh: Any, cfg: MoEConfig) -> tuple[int, int]:
    """(expert axis size N, token shards D) after checking that the mesh fits the config."""
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise ArgumentTypeError(
            f"{op}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}"
        )
    shape = dict(mesh.shape)
    for name in cfg.token_axes:
        if name not in shape:
            role = "expert_axis" if name == cfg.expert_axis else "data_axes"
            raise InvalidArgumentError(
                f"{op}: the mesh has no axis {name!r} (cfg.{role}); its axes are "
                f"{tuple(shape)}. Set MoEConfig(expert_axis=..., data_axes=...) to its names."
            )
    n = shape[cfg.expert_axis]
    if cfg.num_experts % n:
        raise InvalidArgumentError(
            f"{op}: num_experts = {cfg.num_experts} must be divisible by the size {n} of the "
            f"expert axis {cfg.expert_axis!r}"
        )
    return n, math.prod(shape[a] for a in cfg.token_axes)


def _check_x(op: str, x, cfg: MoEConfig) -> jax.Array:
    x = _checks.check_array(op, "x", x, min_rank=2)
    if x.shape[-1] != cfg.hidden_size:
        raise InvalidArgumentError(
            f"{op}: x must have shape (B, ..., H) with H = cfg.hidden_size = {cfg.hidden_size}, "
            f"got {tuple(x.shape)}"
        )
    return x


def _prepare(op: str, params, x, cfg: MoEConfig, mesh, impl):
    """Validates the layer's arguments; (params, x) placed for shard_map, the plan and specs."""
    if not isinstance(cfg, MoEConfig):
        raise ArgumentTypeError(f"{op}: cfg must be a MoEConfig, got {type(cfg).__name__}")
    params = check_params(op, params, cfg)
    x = _check_x(op, x, cfg)
    n, shards = _check_mesh(op, mesh, cfg)
    if x.shape[0] % shards:
        raise InvalidArgumentError(
            f"{op}: x's leading axis ({x.shape[0]}) must be divisible by the {shards} devices "
            f"of the token axes {cfg.token_axes}"
        )
    plan = make_plan(cfg, mesh, n, shards, math.prod(x.shape[:-1]), impl)
    x_spec = P(cfg.token_axes)
    specs = moe_param_specs(cfg)
    return place(params, mesh, specs), place(x, mesh, x_spec), plan, specs, x_spec


def _inside_shard_map(op: str, cfg: MoEConfig) -> bool:
    """Whether the layer is called where cfg's token axes are already manual (shard_map)."""
    manual = manual_axes()
    inside = [a in manual for a in cfg.token_axes]
    if any(inside) and not all(inside):
        raise InvalidArgumentError(
            f"{op}: inside a shard_map, all of cfg's token axes "
            f"{cfg.token_axes} must be manual, got manual axes {tuple(manual)}"
        )
    return all(inside)


def _local_call(op: str, params, x, cfg: MoEConfig, mesh, impl, token_mask):
    """The layer on this device's shards, inside an enclosing shard_map over cfg's axes."""
    n, shards = _check_mesh(op, mesh, cfg)
    local = cfg.num_experts // n
    shapes = {
        name: (local, *shape[1:]) if name in EXPERT_PARAMS else shape
        for name, shape in cfg.param_shapes.items()
    }
    for name, shape in shapes.items():
        arr = params.get(name) if isinstance(params, dict) else None
        if arr is None or tuple(arr.shape) != shape:
            got = None if arr is None else tuple(arr.shape)
            raise InvalidArgumentError(
                f"{op}: inside a shard_map over {cfg.token_axes}, params[{name!r}] must be this "
                f"device's shard of shape {shape} (moe_param_specs), got {got}"
            )
    x = _check_x(op, x, cfg)
    token_mask = check_token_mask(op, token_mask, x)
    plan = make_plan(cfg, mesh, n, shards, math.prod(x.shape[:-1]) * shards, impl)
    return local_layer(cfg, plan, impl, params, x, token_mask=token_mask)


def moe_layer(
    params: dict[str, jax.Array],
    x: jax.Array,
    cfg: MoEConfig,
    *,
    mesh: jax.sharding.Mesh,
    impl: ImplChoice = None,
    token_mask: jax.Array | None = None,
) -> tuple[jax.Array, MoEAux]:
    """The expert-parallel MoE layer: ``y[t] = sum_k probs[t, k] * FFN_{ids[t, k]}(x[t])``.

    ``FFN_e(x) = act(x @ w_in[e] + b_in[e]) @ w_out[e] + b_out[e]`` (biases with
    cfg.expert_bias); with cfg.weight_inputs (Llama 4) the weights scale the experts' inputs
    instead, ``y[t] = sum_k FFN_{ids[t, k]}(probs[t, k] * x[t])``; plus the shared expert, if
    any. Runs as one ``shard_map`` over `mesh` (see the package docstring for the data flow,
    buffer bounds and capacity semantics). Differentiable in params and x (router gradients come
    through the probabilities and the auxiliary losses). Call it under ``jax.jit``.

    Inside an enclosing ``shard_map`` in which cfg's token axes are already manual (a stage of
    :func:`jaxops.parallel.pipeline.pipeline_step`, say), the layer runs directly on this
    device's shards: `params` are then the shards of :func:`moe_param_specs` (``E / N`` local
    experts), `x` this device's tokens and `token_mask` their mask.

    With a `token_mask` (padded or packed batches), a masked-out token is routed to no expert:
    it takes no slot (and no capacity), its output row is 0 (the shared expert's included), no
    gradient reaches it, and it counts in neither ``MoEAux.tokens_per_expert`` / ``dropped`` nor
    the losses, which are means over the unmasked tokens of the whole global batch (all 0 when
    there is none). The capacity C is still computed from the static token count (masked tokens
    included), so the buffers keep static shapes.

    Args:
      params: from :func:`init_moe_params` (float32 or cfg.dtype; any placement, resharded to
        :func:`moe_param_specs`).
      x: ``[B, ..., H]`` float32, bfloat16 or float16 (``H = cfg.hidden_size``); B divisible by
        the number of devices on the token axes ``(*cfg.data_axes, cfg.expert_axis)``, over
        which B is sharded.
      cfg: a :class:`MoEConfig`.
      mesh: the mesh holding cfg's axes (other axes hold replicas).
      impl: jaxops' implementation policy (:func:`jaxops.choose_impl`: None, "ffi", "xla" or an
        order of preference such as ``("ffi", "xla")``) for every kernel the layer runs
        (permute, unpermute, FP8 quantization, the grouped GEMMs, and with ``cfg.fp8`` the FP8
        GEMMs); "ffi" requires a custom call for each of them.
      token_mask: None (every token counts) or a bool array of shape ``x.shape[:-1]``, True for
        the tokens that count (an integer array is read as ``!= 0``); sharded like x.

    Returns:
      ``(y, aux)``: y like x, and a :class:`MoEAux`.

    Raises:
      TypeError / ValueError: bad params, x, token_mask, mesh or config (named, with what was
        expected).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxops.parallel.expert import MoEConfig, init_moe_params, moe_layer
      >>> mesh = jax.make_mesh((len(jax.devices()),), ("expert",))
      >>> cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, expert_ffn=128, data_axes=())
      >>> params = init_moe_params(jax.random.key(0), cfg)
      >>> x = jax.random.normal(jax.random.key(1), (8, 16, 64), jnp.bfloat16)
      >>> y, aux = jax.jit(lambda p, x: moe_layer(p, x, cfg, mesh=mesh))(params, x)
      >>> y.shape, y.dtype, int(aux.tokens_per_expert.sum())
      ((8, 16, 64), dtype(bfloat16), 256)
    """
    op = f"{_PREFIX}.moe_layer"
    if isinstance(cfg, MoEConfig) and _inside_shard_map(op, cfg):
        return _local_call(op, params, x, cfg, mesh, impl, token_mask)
    params, x, plan, specs, x_spec = _prepare(op, params, x, cfg, mesh, impl)
    token_mask = check_token_mask(op, token_mask, x)
    aux_specs = MoEAux(P(), P(), P(), P(), P())
    body = functools.partial(local_layer, cfg, plan, impl)
    args, in_specs = (params, x), (specs, x_spec)
    if token_mask is not None:  # sharded like x
        args, in_specs = (*args, place(token_mask, mesh, x_spec)), (*in_specs, x_spec)
    return jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=(x_spec, aux_specs), check_vma=True
    )(*args)


def stage_probe(params, x, cfg: MoEConfig, *, mesh, upto: str, impl: str | None = None):
    """The layer cut after stage `upto` (one of :data:`STAGES`): a float32 per token shard.

    For benchmarks: timing the cuts one after another splits the layer's time into router /
    permute / exchange / FFN / combine (exchange back + unpermute).
    """
    op = f"{_PREFIX}._stage_probe"
    if upto not in STAGES:
        raise InvalidArgumentError(f"{op}: upto must be one of {STAGES}, got {upto!r}")
    params, x, plan, specs, x_spec = _prepare(op, params, x, cfg, mesh, impl)

    def body(p, x):
        out = local_layer(cfg, plan, impl, p, x, upto=upto)
        return _probe(out[0]) if upto == "combine" else out  # the whole layer, reduced alike

    return jax.shard_map(
        body, mesh=mesh, in_specs=(specs, x_spec), out_specs=P(cfg.token_axes), check_vma=True
    )(params, x)
