"""How the decoder runs its layers: scans over the stacked layers, remat, ZeRO-3 gathers.

Functions of a :class:`~jaxops.models._layout.Layout` that turn the stacked parameters into
``lax.scan`` s of :func:`jaxops.models._layers.decoder_layer`: one scan per run of consecutive
layers of one kind, or one over the repeats of a dense / MoE pattern, each layer rematerialized
as ``remat`` says and, with ``zero = 3``, its weights gathered as it runs; and one pipeline
stage (:func:`stage`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxops.parallel import expert as ep

from . import _base, _layers
from ._layout import GATHERED, Layout, without_gathered

__all__ = ["ffn", "layer_step", "run_all", "run_layers", "stage"]


def _moe_fn(layout: Layout) -> Callable:
    """``moe(params, y, token_mask)``: the MoE layer; padding (mask False) is not routed."""
    cfg = layout.moe

    def moe(p, y, token_mask=None):
        if layout.moe_impl == "dense":
            return ep.moe_layer_reference(p, y, cfg, impl=layout.impl, token_mask=token_mask)
        return ep.moe_layer(p, y, cfg, mesh=layout.mesh, impl=layout.impl, token_mask=token_mask)

    return moe


def ffn(layout: Layout, key: str) -> Callable:
    """The ffn of the layers of stack `key` for ``_layers.decoder_layer``.

    "layers": the MoE layer on ``p["moe"]`` (aux its MoEAux); "dense_layers": the dense
    MLP on ``p["mlp"]`` (aux None).
    """
    if key == "dense_layers":
        ops = layout.ops
        return lambda p, y, token_mask: (_layers.mlp(ops, p["mlp"], y), None)
    moe = _moe_fn(layout)
    return lambda p, y, token_mask: moe(p["moe"], y, token_mask)


def run_all(
    layout: Layout,
    params: dict[str, Any],
    h: jax.Array,
    where: _layers.Tokens,
    *,
    prefix: bool = False,
) -> tuple[jax.Array, ep.MoEAux | None]:
    """``h`` through every layer in order (one ``lax.scan`` per run of one kind).

    Layers that repeat a pattern of both kinds (:attr:`Layout.period`: Llama 4 Maverick's
    dense / MoE alternation) run as one scan over the repeats. Returns the MoE layers' MoEAux
    stacked ``[Lm, ...]``. With `prefix`, only the dense layers before the first MoE layer
    (what runs ahead of a pipeline; aux None).
    """
    period = None if prefix else layout.period
    dropout = params.get(_layers.DROPOUT_KEY)  # a training step's LoRA dropout key
    auxes = []
    for key, start, stop, first in layout.runs_in(period[0] if period else None):
        if prefix and key == "layers":
            break
        stack = params[key]
        if (start, stop) != (0, jax.tree.leaves(stack)[0].shape[0]):
            stack = jax.tree.map(lambda a, i=start, j=stop: a[i:j], stack)
        rows = range(first, first + stop - start)  # consecutive layers of one kind
        kinds = _layers.layer_kinds(layout.config, rows)
        keys = _layer_keys(dropout, first, stop - start)
        h, aux = run_layers(layout, stack, h, where, key, kinds, gather=True, keys=keys)
        if key == "layers":
            auxes.append(aux)
    if period is not None:
        h, aux = _run_period(layout, params, h, where, *period, dropout=dropout)
        auxes.append(aux)
    if not auxes:
        return h, None
    return h, auxes[0] if len(auxes) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *auxes)


def _layer_keys(key: jax.Array | None, first: int, n: int) -> jax.Array | None:
    """The dropout keys of model layers ``first .. first + n - 1`` (one each), or None."""
    if key is None:
        return None
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(first, first + n))


def _run_period(
    layout: Layout,
    params: dict[str, Any],
    h: jax.Array,
    where: _layers.Tokens,
    first: int,
    keys: tuple[str, ...],
    dropout: jax.Array | None = None,
) -> tuple[jax.Array, ep.MoEAux]:
    """Layers ``first ..`` as repeats of the stacks `keys`, one ``lax.scan`` over them."""
    c = layout.config
    groups = (c.num_layers - first) // len(keys)
    xs = {}
    for key in dict.fromkeys(keys):
        per, start = keys.count(key), layout.stack_rows(first)[key]
        xs[key] = jax.tree.map(
            lambda a, i=start, n=per: a[i : i + groups * n].reshape(groups, n, *a.shape[1:]),
            params[key],
        )
    static, scanned = _layers.layer_kinds(c, range(first, c.num_layers))
    if scanned is not None:
        scanned = jax.tree.map(lambda a: a.reshape(groups, len(keys)), scanned)
    steps = {k: layer_step(layout, k, where, static, gather=True) for k in xs}
    drop = _layer_keys(dropout, first, c.num_layers - first)
    if drop is not None:
        drop = drop.reshape(groups, len(keys), *drop.shape[1:])

    def body(h, x):
        stacks, kinds, drop = x
        seen = dict.fromkeys(stacks, 0)
        auxes = []
        for j, key in enumerate(keys):
            p = jax.tree.map(lambda a, i=seen[key]: a[i], stacks[key])
            seen[key] += 1
            kind = None if kinds is None else jax.tree.map(lambda a, j=j: a[j], kinds)
            h, aux = steps[key](h, (p, kind, None if drop is None else drop[j]))
            if key == "layers":
                auxes.append(aux)
        return h, jax.tree.map(lambda *a: jnp.stack(a), *auxes)

    h, aux = jax.lax.scan(body, h, (xs, scanned, drop), unroll=layout.unroll)
    return h, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), aux)


def layer_step(
    layout: Layout, key: str, where: _layers.Tokens, static: _layers.LayerKind, gather: bool
) -> Callable:
    """One layer of stack `key` as a scan body ``(h, (params, kind, dropout key)) -> (h, aux)``.

    `kind`: the layer's attention pattern where the layers' differ (else None: `static`);
    the dropout key: the training step's LoRA dropout key of this layer, or None.

    Rematerialized as ``remat`` says (:attr:`Layout.remat_policy`); `gather`: ZeRO-3 gathers
    its weights (outside a pipeline stage, whose weights its shard_map gathered) and again in
    its backward. A quantized base's weights are dequantized in the body, and again in its
    backward (never saved for it: no float copy of the base outlives its layer).
    """
    decoder_layer = functools.partial(
        _layers.decoder_layer, layout.ops, layout.config, ffn(layout, key), where, static
    )

    def layer(h, xs):  # a quantized base's weights dequantized where the layer starts
        p, kind, drop = xs
        p = layout.dequantized(p, key)
        if drop is not None:  # the training step's LoRA dropout key of this layer
            p = {**p, _layers.DROPOUT_KEY: drop}
        return decoder_layer(h, p if kind is None else (p, kind))

    remat = layout.remat_policy
    body = layer
    unsaved = () if layout.base is None else (_base.DEQUANTIZED,)
    if gather and layout.zero == 3:

        def one(specs):  # a layer's specs: the stack's without its layer axis
            return jax.tree.map(lambda s: P(*s[1:]), specs[key], is_leaf=_is_spec)

        specs, source = one(layout.compute_specs()), one(layout.zero_specs())

        def body(h, xs):
            return layer(h, (layout.gather(xs[0], specs, source), *xs[1:]))

        unsaved = (*unsaved, GATHERED)
    if unsaved:  # recomputed in the backward, never kept for it
        remat = without_gathered(remat, unsaved)
    if remat is not False:
        body = jax.checkpoint(body, policy=None if remat is True else remat)
    return body


def run_layers(
    layout: Layout,
    layers: dict[str, Any],
    h: jax.Array,
    where: _layers.Tokens,
    key: str,
    kinds: tuple[_layers.LayerKind, _layers.LayerKind | None],
    gather: bool = False,
    keys: jax.Array | None = None,
) -> tuple[jax.Array, ep.MoEAux]:
    """``h`` through the stacked `layers` of stack `key` (one lax.scan).

    `kinds`: their attention patterns (``_layers.layer_kinds``: one for all, or per-layer
    arrays scanned with the parameters). Returns ``(h, aux)``: the per-layer aux (MoEAux
    of MoE layers, None for dense ones), stacked. `gather`: as in :func:`layer_step`; `keys`:
    the layers' LoRA dropout keys (a training step's), or None.
    """
    static, scanned = kinds
    body = layer_step(layout, key, where, static, gather)
    xs = (layers, scanned, keys)
    return jax.lax.scan(body, h, xs, unroll=layout.unroll)


def stage(
    layout: Layout, sp: dict[str, Any], carry: dict[str, Any]
) -> tuple[dict[str, Any], jax.Array]:
    """One pipeline stage on ``{"h", "where"}``: its layers, the sum of their aux losses.

    (``functools.partial(stage, layout)`` is the stage function of
    :func:`jaxops.parallel.pipeline.pipeline_step` and ``pipeline_forward``.)
    """
    c = layout.config
    static, scanned = _layers.layer_kinds(c, c.moe_layers)
    if scanned is not None:  # this stage's rows (stage s holds MoE rows s n .. s n + n - 1)
        n = jax.tree.leaves(sp)[0].shape[0]
        index = jax.lax.axis_index(layout.pipe_axis)
        scanned = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, index * n, n), scanned)
    h, aux = run_layers(layout, sp, carry["h"], carry["where"], "layers", (static, scanned))
    return {**carry, "h": h}, jnp.sum(aux.loss)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)
