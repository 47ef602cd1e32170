"""The decoder's training objective: the loss, gradient accumulation and the pipeline step.

Functions of the decoder's :class:`~jaxops.models._layout.Layout` (``model.layout``) and a
validated batch (:class:`~jaxops.models._batch.Batch`): the embedded inputs and the last
layer's output; the cross-entropy over the counted targets of the whole global batch plus the
MoE aux losses, without a pipeline (one pass, or microbatches one after another), through a
forward-only pipeline, and as one pipeline step (the schedule's backward).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxops.parallel import pipeline as pl

from jaxops._sharding import place

from . import _batch, _flat, _layers, _mtp, _run
from ._adapters import adapters_of
from ._layout import Layout

__all__ = [
    "accumulate",
    "flat_loss_and_grads",
    "hidden",
    "inputs",
    "loss_and_grads",
    "objective",
    "pipe_loss",
    "pipeline_step",
    "terms",
    "trainable",
    "where_targets",
]


def where_targets(batch: _batch.Batch) -> tuple[_layers.Tokens, jax.Array | None]:
    """``(where, targets)``: the tokens' placement; targets at padding are ignored."""
    placed = _batch.placement(batch)
    targets = batch.targets
    if targets is not None and placed.segments is not None:
        targets = jnp.where(placed.valid, targets, _layers.IGNORE_INDEX)
    return placed, targets


def inputs(layout: Layout, params: dict[str, Any], batch: _batch.Batch):
    """``(embedded tokens, where, targets)``: padding embeds as 0, its targets are ignored.

    (Zero rows at padding: whatever id a padding token holds, even one out of range, never
    reaches a real token through the attention's ``0 * value``.)
    """
    placed, targets = where_targets(batch)
    return layout.embed(params["embed"], batch.tokens, placed), placed, targets


def hidden(layout: Layout, params: dict[str, Any], batch: _batch.Batch) -> jax.Array:
    """The last layer's output ``[B, S, D]`` (through the pipeline's forwards with a pipe axis)."""
    x, placed, _ = inputs(layout, params, batch)
    if layout.pipe > 1:
        stages = layout.stages(params["layers"])
        carry = {"h": _run.run_all(layout, params, x, placed, prefix=True)[0], "where": placed}
        stage = functools.partial(_run.stage, layout)
        return pl.pipeline_forward(stage, stages, carry, **layout.pipeline_keywords())["h"]
    return _run.run_all(layout, params, x, placed)[0]


def terms(
    layout: Layout, params, x, where, targets, mtp: tuple[_batch.Batch, jax.Array] | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(summed cross-entropy, summed MoE aux losses, MTP term) of one batch without a pipeline.

    `mtp`: ``(batch, counts)``: the batch's MTP inputs and targets (:func:`_mtp.shifted`) and
    each depth's counted targets in the whole global batch; the MTP term is then
    :func:`_mtp.term` of this batch's share (0 without), the MTP modules' aux losses added to
    the trunk's.
    """
    h, aux = _run.run_all(layout, params, x, where)
    head = layout.head_params(params)  # gathered once (ZeRO-3) for the trunk and the depths
    total, _ = layout.losses(head, h, targets)
    aux = jnp.sum(aux.loss)
    if mtp is None:
        return total, aux, jnp.zeros((), jnp.float32)
    batch, n = mtp
    totals, mtp_aux = _mtp.losses(
        layout, params, head, h, where, batch.mtp_tokens, batch.mtp_targets
    )
    return total, aux + mtp_aux, _mtp.term(layout, totals, n)


def _mtp_counts(batch: _batch.Batch, axes: tuple[str, ...] = ()) -> jax.Array | None:
    """Each MTP depth's counted targets in the global batch (None: no MTP term)."""
    return None if batch.mtp_targets is None else _mtp.counts(batch.mtp_targets, axes)


def accumulate(
    layout: Layout,
    params,
    batch: _batch.Batch,
    grads: bool,
    dropout_key: jax.Array | None = None,
):
    """The loss (and its gradients) over the microbatches without a pipeline, one at a time.

    Each microbatch adds its summed cross-entropy over the global target count and its MoE
    aux losses over M; the gradients accumulate in float32 (with LoRA the adapters' only:
    :func:`trainable`). `dropout_key`: the LoRA dropout key, each microbatch folding in its
    index.
    """
    m = layout.num_microbatches
    count = _target_count(where_targets(batch)[1])
    n = _mtp_counts(batch)
    parts = _batch.split_microbatches(batch, m, (layout.mesh, layout.batch_axes))
    wrt = trainable(layout, params)

    def one(wrt, mb, i):
        p = layout.with_trained(wrt, params)
        if dropout_key is not None:  # each microbatch its own dropout masks
            p = {**p, _layers.DROPOUT_KEY: jax.random.fold_in(dropout_key, i)}
        x, where, targets = inputs(layout, p, mb)
        total, aux, extra = terms(layout, p, x, where, targets, None if n is None else (mb, n))
        return total / count + aux / m + extra

    f32 = functools.partial(jax.tree.map, lambda a: jnp.zeros_like(a, jnp.float32))
    xs = (parts, jnp.arange(m))
    if not grads:
        return jax.lax.scan(lambda acc, x: (acc + one(wrt, *x), None), 0.0, xs)[0]

    def body(acc, x):
        loss, g = jax.value_and_grad(one)(wrt, *x)
        g = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc[1], g)
        return (acc[0] + loss, g), None

    (loss, g), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), f32(wrt)), xs)
    return loss, jax.tree.map(lambda a, p: a.astype(p.dtype), g, wrt)


def trainable(layout: Layout, params: dict[str, Any]) -> Any:
    """What the gradients are taken of: :meth:`Layout.trainable` (with LoRA the adapters only).

    (Every other leaf None: the frozen weights' gradients are never computed.)
    """
    return layout.trainable(params)


def loss_and_grads(
    layout: Layout,
    params: dict[str, Any],
    batch: _batch.Batch,
    dropout_key: jax.Array | None = None,
):
    """``(loss, grads of :func:`trainable`)`` without a pipeline, by ``jax.value_and_grad``.

    Over the microbatches one at a time when there are several. `dropout_key`: the step's
    LoRA dropout key (each layer folds in its index, each microbatch its own), or None.
    """
    if layout.num_microbatches > 1:
        return accumulate(layout, params, batch, grads=True, dropout_key=dropout_key)
    wrt = trainable(layout, params)

    def loss(wrt, batch):
        p = layout.with_trained(wrt, params)
        if dropout_key is not None:
            p = {**p, _layers.DROPOUT_KEY: dropout_key}
        return objective(layout, p, batch)

    return jax.value_and_grad(loss)(wrt, batch)


def objective(layout: Layout, params: dict[str, Any], batch: _batch.Batch) -> jax.Array:
    """The training loss: cross-entropy over the counted targets plus the MoE aux losses.

    The cross-entropy is summed over every target that is not ignored (-100, or padding)
    and divided by their number in the whole global batch. Without a pipeline and one
    microbatch the aux losses are each layer's over the whole batch; otherwise per
    microbatch, averaged over the microbatches (and data shards with a pipeline), as
    :meth:`MoEDecoder.loss_and_grads` computes them (with a pipeline: from a forward-only
    pipeline in which each stage adds its aux loss to a per-example carry). With the MTP
    modules trained, their term and aux losses are added (per microbatch after a pipeline).
    """
    if layout.pipe == 1 and layout.num_microbatches > 1:
        return accumulate(layout, params, batch, grads=False)
    x, where, targets = inputs(layout, params, batch)
    count = _target_count(targets)
    if layout.pipe == 1:
        n = _mtp_counts(batch)
        mtp = None if n is None else (batch, n)
        total, aux, extra = terms(layout, params, x, where, targets, mtp)
        return total / count + aux + extra

    def stage(sp, carry):
        out, aux = _run.stage(layout, sp, carry)
        return {**out, "aux": carry["aux"] + aux}, jnp.zeros((), jnp.float32)

    x = _run.run_all(layout, params, x, where, prefix=True)[0]  # the dense layers ahead
    carry = {"h": x, "where": where, "aux": layout.place(jnp.zeros(x.shape[:1], jnp.float32))}
    stages = layout.stages(params["layers"])
    out = pl.pipeline_forward(stage, stages, carry, **layout.pipeline_keywords())
    head = layout.head_params(params)
    total, _ = layout.losses(head, out["h"], targets)
    loss = total / count + jnp.mean(out["aux"])
    if batch.mtp_targets is not None:
        loss = loss + _pipeline_mtp(layout, params, head, out["h"], where, batch)
    return loss


def _pipeline_mtp(layout: Layout, params, head, h, where, batch: _batch.Batch) -> jax.Array:
    """The MTP term plus the modules' aux losses after a forward-only pipeline.

    Per microbatch, as :func:`pipeline_step` computes them on the last stage: the aux losses
    averaged over the microbatches, the term's shares over the whole batch's counts summed.
    """
    m = layout.num_microbatches
    n = _mtp.counts(batch.mtp_targets)
    tree = {"h": h, "where": where, "tokens": batch.mtp_tokens, "targets": batch.mtp_targets}
    parts = _batch.split_microbatches(tree, m, (layout.mesh, layout.batch_axes))

    def one(acc, part):  # one microbatch (a scan: one copy of the modules in the program)
        totals, aux = _mtp.losses(
            layout, params, head, part["h"], part["where"], part["tokens"], part["targets"]
        )
        return acc + _mtp.term(layout, totals, n) + aux / m, None

    return jax.lax.scan(one, jnp.zeros((), jnp.float32), parts)[0]


def flat_loss_and_grads(
    layout: Layout, params: dict[str, Any], batch: _batch.Batch, scatter: bool = False
):
    """``(loss, grads)`` without a pipeline, in one ``shard_map`` over the batch axes.

    Each device differentiates its share of the loss (its tokens' cross-entropy over the
    global target count, plus the aux losses over the devices: the MoE layers compute them
    from statistics summed over the batch axes, so every device holds the whole value) with
    respect to its shards of the parameters; then the gradients are summed over the batch axes
    their parameter is replicated over as flat buffers (:mod:`~jaxops.models._flat`): one
    collective per group of leaves instead of one per leaf. With `scatter` each device keeps
    only its ZeRO shard of each gradient (laid out by :meth:`Layout.zero_specs`; ZeRO-1's
    update reads nothing else). The shard_map runs unchecked (``check_vma=False``), so that the
    per-device gradients come out unreduced; the transpose of each collective inside (the MoE
    exchange's, the statistics' sums) is then the one the sum of the devices' losses needs.
    """
    axes = tuple(layout.batch_axes)
    devices = float(layout.batch_devices)
    specs = jax.tree.map(lambda s: s.spec, layout.shardings())
    zero = layout.zero_specs()
    fields = {k: v for k, v in vars(batch).items() if v is not None}

    def body(params, fields):
        local = _batch.Batch(**{k: fields.get(k) for k in vars(batch)})
        n = _mtp_counts(local, axes)

        def share(wrt):
            p = layout.with_trained(wrt, params)
            x, where, targets = inputs(layout, p, local)
            count = jax.lax.psum(_target_count(targets), axes)
            mtp = None if n is None else (local, n)
            total, aux, extra = terms(layout, p, x, where, targets, mtp)
            return total / count + aux / devices + extra

        loss, grads = jax.value_and_grad(share)(layout.trainable(params))
        if scatter:
            grads = _flat.scatter_flat(grads, trained_specs, trained_zero, layout.mesh, axes)
        else:
            grads = _flat.sum_flat(grads, trained_specs, layout.mesh, axes)
        return jax.lax.psum(loss, axes), grads

    trained_specs, trained_zero = layout.trainable_specs(specs), layout.trainable_specs(zero)
    field_specs = jax.tree.map(lambda _: P(axes), fields)
    return jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(specs, field_specs),
        out_specs=(P(), trained_zero if scatter else trained_specs),
        check_vma=False,
    )(place(params, layout.mesh, specs), place(fields, layout.mesh, field_specs))


def pipeline_step(
    layout: Layout,
    params: dict[str, Any],
    batch: _batch.Batch,
    objective: Callable[[dict[str, Any], jax.Array, Any], jax.Array] | None = None,
    rows: Any = None,
):
    """``(loss, grads of :func:`trainable`)`` of one pipeline_step (the schedule).

    With LoRA the base weights and the head are the pipeline's ``frozen`` leaves: only the
    adapters' gradients are computed (in the stages, in the dense layers ahead of them and in
    the MTP modules after them).
    `objective`: None (the cross-entropy over the counted targets), or ``(head, h, rows) ->``
    a microbatch's share of a loss normalized over the whole batch (post-training's), with
    `rows` a pytree of ``[B, ...]`` arrays split with the batch (the last stage's output `h`
    of that microbatch's rows, on its device). The MoE aux losses are added as the model's
    loss has them. With the MTP modules trained (and `objective` None), they run after the
    last stage inside its loss, on its devices, and their term is added.
    """
    lora = layout.lora is not None
    where, targets = where_targets(batch)
    ahead = {k: params[k] for k in ("embed", "dense_layers") if k in params}
    wrt = trainable(layout, ahead)
    # with LoRA, the layers ahead differentiated only if they hold adapters
    ahead_grads = not lora or bool(jax.tree.leaves(wrt))

    def front(wrt):  # the embedding and the dense layers ahead of the stages
        ahead_ = layout.with_trained(wrt, ahead)
        x = layout.embed(ahead_["embed"], batch.tokens, where)
        return _run.run_all(layout, ahead_, x, where, prefix=True)[0]

    if ahead_grads:
        x, ahead_vjp = jax.vjp(front, wrt)
    else:
        x = front(wrt)
    # pipeline_step averages each microbatch's loss over the M microbatches of each of the
    # data shards: scaling each by M * shards / count makes that the global token mean.
    shards = layout.batch_devices
    mtp = objective is None and layout.mtp_trained
    extra, extra_specs, embed_vjp = (), (), None  # loss_params after (head, scale)
    if objective is None:
        scale = layout.num_microbatches * shards / _target_count(targets)
        if mtp:  # the MTP modules after the last stage, on its devices
            laid, laid_specs, targets, embed_vjp = _mtp_inputs(
                layout, params, batch, where, targets
            )
            extra, extra_specs = (laid,), (laid_specs,)

        def loss_fn(lp, out, t):
            head, s = lp[:2]
            if not mtp:
                return layout.losses(head, out["h"], t)[0] * s
            total = layout.losses(head, out["h"], t["targets"])[0] * s
            p = lp[2]
            totals, aux = _mtp.losses(
                layout, p, head, out["h"], out["where"], None, t["mtp"], False, t["embedded"]
            )
            # the term's share of this microbatch, undoing pipeline_step's mean like `s`; the
            # MTP layers' aux losses averaged over the microbatches like the stages'
            share = _mtp.term(layout, totals, p["counts"]) * layout.num_microbatches * shards
            return total + share + aux

    else:  # already normalized over the whole batch: undo pipeline_step's averaging only
        scale, targets = jnp.float32(layout.num_microbatches * shards), rows

        def loss_fn(lp, out, t):
            head, s = lp[:2]
            return objective(head, out["h"], t) * s

    # the head gathered in its own dtype: pipeline_step returns its gradient in it
    head = layout.head_params(params, cast=False)
    stages = layout.stages(params["layers"])
    # with LoRA: every stage leaf but the adapters, and the head, read and not trained (the
    # MTP modules' adapters, in the loss's parameters, trained)
    frozen = (jax.tree.map(lambda a: a is None, adapters_of(stages), is_leaf=_is_none), True)
    if lora and mtp:
        laid = jax.tree.map(lambda a: a is None, adapters_of(extra[0]), is_leaf=_is_none)
        frozen = (frozen[0], (True, True, laid))
    loss, g = pl.pipeline_step(
        functools.partial(_run.stage, layout),
        stages,
        {"h": x, "where": where},
        targets=targets,
        loss_params=(head, scale, *extra),
        loss_param_specs=(jax.tree.map(lambda _: P(), head), P(), *extra_specs),
        loss_fn=loss_fn,
        schedule=layout.schedule,
        remat=layout.remat_policy,
        input_grads=ahead_grads,
        frozen=frozen if lora else None,
        **layout.pipeline_keywords(),
    )
    layers = jax.tree.map(
        lambda a, p: None if a is None else a.reshape(p.shape),
        g.stage_params,
        params["layers"],
        is_leaf=_is_none,
    )
    d_ahead = ahead_vjp(g.inputs["h"])[0] if ahead_grads else wrt
    if lora:
        grads = {**adapters_of(params), **d_ahead, "layers": layers}
        if mtp:  # the MTP modules' adapters' gradients (None at their frozen leaves)
            grads["mtp"] = g.loss_params[2]["mtp"]
        return loss, grads
    d_embed = d_ahead["embed"]
    head = g.loss_params[0]
    grads = {"embed": d_embed, "layers": layers, "final_norm": head["final_norm"]}
    if "dense_layers" in d_ahead:
        grads["dense_layers"] = d_ahead["dense_layers"]
    if layout.config.tie_word_embeddings:
        grads["embed"] = d_embed + head["embed"]
    else:
        grads["lm_head"] = head["lm_head"]
    if mtp:  # the MTP modules' gradients, and their embedding lookups' (the targets')
        grads["mtp"] = g.loss_params[2]["mtp"]
        grads["embed"] = grads["embed"] + embed_vjp(g.targets["embedded"])[0]
    elif "mtp" in params:  # frozen: None leaves (post-training refuses trained ones)
        grads["mtp"] = layout.trainable(params)["mtp"]
    return loss, grads


def _mtp_inputs(
    layout: Layout, params: dict[str, Any], batch: _batch.Batch, where: _layers.Tokens, targets
):
    """What the pipeline's loss needs for the MTP term: ``(inputs, specs, targets, embed_vjp)``.

    The inputs (loss_params): the modules' parameters laid out for the computation (the MoE
    block's experts over the expert axis, the rest replicated: a ZeRO-3 layout gathered here,
    before the pipeline) and each depth's counted targets in the whole batch. The targets: a
    dict of the trunk's targets and the depths' embedded inputs and targets, split into
    microbatches with the batch: the depths' tokens are embedded here, so that no stage holds
    the embedding table, and `embed_vjp` takes the pipeline's gradient of the embedded
    inputs to the table's.
    """
    compute, zero = layout.compute_specs(), layout.zero_specs()
    inputs = {
        "mtp": layout.gather(params["mtp"], compute["mtp"], zero["mtp"], cast=False),
        "counts": _mtp.counts(batch.mtp_targets),
    }
    specs = {"mtp": compute["mtp"], "counts": P()}
    embedded, embed_vjp = jax.vjp(
        lambda table: _mtp.embedded(layout, table, batch.mtp_tokens, where), params["embed"]
    )
    t = {"targets": targets, "embedded": embedded, "mtp": batch.mtp_targets}
    return inputs, specs, t, embed_vjp


def pipe_loss(layout: Layout) -> Callable:
    """The pipe mesh's loss, differentiable: its gradient is the pipeline step's.

    A ``jax.custom_vjp``: its value is the forward-only pipeline's; under ``jax.grad`` the
    forward runs :func:`pipeline_step` (the schedule's forwards and backwards) and the backward
    scales its gradients by the cotangent.
    """

    @jax.custom_vjp
    def loss(params, batch):
        return objective(layout, params, batch)

    def fwd(params, batch):
        value, grads = pipeline_step(layout, params, batch)
        return value, (grads, batch)

    def bwd(res, ct):
        grads, batch = res
        zeros = jax.tree.map(_float0_zeros, batch)
        return jax.tree.map(lambda g: (g * ct).astype(g.dtype), grads), zeros

    loss.defvjp(fwd, bwd)
    return loss


def _is_none(x: Any) -> bool:
    return x is None


def _target_count(targets: jax.Array) -> jax.Array:
    """The number of counted targets (at least 1: no target gives a zero loss, not 0 / 0)."""
    return jnp.maximum(jnp.sum(targets != _layers.IGNORE_INDEX, dtype=jnp.float32), 1.0)


def _float0_zeros(a: jax.Array) -> Any:
    """The zero cotangent of an input: float0 for integers, zeros for floats."""
    if jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == bool:
        return np.zeros(a.shape, jax.dtypes.float0)
    return jnp.zeros_like(a)
