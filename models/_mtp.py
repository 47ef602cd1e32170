"""Multi-token prediction: DeepSeek-V3's and GLM-4.5's MTP modules, their inputs and their loss.

The config's ``mtp_layers`` = D modules run after the trunk. Depth k (1..D) at position i
combines the previous depth's output (for k = 1 the trunk's last layer output after its final
norm) with the embedding of token ``i + k``, runs one MoE decoder layer of the model's kind and
predicts token ``i + k + 1`` through the shared output head::

    x = eh_proj [enorm(embed(t[i + k])) ; hnorm(h[k - 1])]      the embedding's half first
    y = decoder_layer(x)                                          an MoE layer of the model's
    h[k] = head_norm(y)            logits[k] = h[k] @ lm_head     (``shared_head.norm``)

as the published checkpoints store them (``model.layers.{L + k - 1}.enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm`` and the layer's own tensors) and as the serving engines and
Megatron-Core run them. Depth k + 1 reads depth k's output after ``head_norm`` (Megatron's
order; the published checkpoints have D = 1, so no checkpoint decides it).

The parameters are ``params["mtp"]``, each leaf stacked ``[D, ...]``
(:meth:`~jaxops.models._layout.Layout.weight_shapes`). A module's layer is laid out as the
trunk's MoE layers (:attr:`~jaxops.models._layout.Layout.mtp_layout`): in FP8 with a quantized
base, with LoRA adapters on the trunk's targets when the MTP loss trains the modules of a model
with adapters. The inputs and targets of every depth
are cut from the batch before it is split (:func:`shifted`), so that a context axis's rows and
the microbatches carry them like the tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxops

from . import _batch, _layers, _run
from ._layout import Layout

__all__ = ["BLOCK", "counts", "embedded", "hidden", "losses", "shifted", "term"]

#: The tree key of the modules' layers (``params["mtp"]["block"]``, stacked over the depths).
BLOCK = "mtp/block"


def shifted(batch: _batch.Batch, depth: int) -> _batch.Batch:
    """`batch` with the inputs and targets of depths 1..`depth` (``[B, S, depth]`` each).

    Depth k at position i reads token ``i + k`` and predicts target ``i + k`` (the token
    ``i + k + 1`` for targets that are the tokens shifted by one). Where ``i + k`` lies past
    the sequence, in another document (``segment_ids``) or at padding, or i itself is padding,
    the target is ignored and the token read is 0 (what it reads there never reaches a counted
    target: attention stays within a document and causal).
    """
    tokens, targets = batch.tokens, batch.targets
    b, s = tokens.shape
    doc = _batch.placement(batch).segments
    if doc is None:
        doc = jnp.ones((b, s), jnp.int32)
    ins, outs = [], []
    for k in range(1, depth + 1):
        n = min(k, s)

        def ahead(a, fill, n=n):
            return jnp.pad(a[:, n:], ((0, 0), (0, n)), constant_values=fill)

        same = ahead(doc, 0) == doc
        same &= (doc != 0) & (ahead(doc, 0) != 0)
        ins.append(jnp.where(same, ahead(tokens, 0), 0).astype(tokens.dtype))
        if targets is not None:
            ignored = _layers.IGNORE_INDEX
            outs.append(jnp.where(same, ahead(targets, ignored), ignored).astype(targets.dtype))
    return dataclasses.replace(
        batch,
        mtp_tokens=jnp.stack(ins, axis=-1),
        mtp_targets=jnp.stack(outs, axis=-1) if outs else None,
    )


def _depth(layout: Layout, params: dict[str, Any], k: int, gather: bool) -> dict[str, Any]:
    """Depth k's parameters (0-based), laid out as the module uses them (`gather`: ZeRO-3's)."""
    p = jax.tree.map(lambda a: a[k], params["mtp"])
    if layout.zero != 3 or not gather:
        return p

    def one(specs):  # without the stacked depth axis
        return jax.tree.map(lambda s: P(*s[1:]), specs["mtp"], is_leaf=_is_spec)

    return layout.gather(p, one(layout.compute_specs()), one(layout.zero_specs()))


def hidden(
    layout: Layout,
    params: dict[str, Any],
    head: dict[str, Any],
    h: jax.Array,
    where: _layers.Tokens,
    tokens: jax.Array | None,
    gather: bool = True,
    embedded: jax.Array | None = None,
) -> tuple[list[tuple[dict[str, Any], jax.Array]], jax.Array]:
    """``([(head_k, y_k)] for each depth, summed MoE aux loss)``.

    `head`: the trunk's head (``layout.head_params``, gathered once for the trunk's loss and
    the depths'); `h`: the trunk's last layer output ``[B, S, D]`` (before its final norm);
    `tokens`: the depths' input tokens ``[B, S, depth]`` (:func:`shifted`).
    ``layout.head(head_k, y_k)`` are depth k's logits (``head_k``: the output head with the
    depth's ``head_norm`` for the final norm). `gather` False: ``params["mtp"]`` is laid out
    for the computation already (ZeRO-3 gathers nothing: inside a pipeline's loss, given it
    gathered); `embedded`: the tokens embedded already (:func:`embedded`; `tokens` unused).
    """
    c, ops = layout.config, layout.ops
    eps = c.rms_norm_eps
    x = jaxops.rms_norm(h, head["final_norm"], eps=eps, impl=ops.impl)
    static, scanned = _layers.layer_kinds(c, [c.num_layers - 1])  # the last layer's pattern
    kind = None if scanned is None else jax.tree.map(lambda a: a[0], scanned)
    step = _run.layer_step(layout.mtp_layout, BLOCK, where, static, gather=False)
    dropout = params.get(_layers.DROPOUT_KEY)  # a training step's LoRA dropout key
    out, aux = [], jnp.zeros((), jnp.float32)
    for k in range(c.mtp_layers):
        p = _depth(layout, params, k, gather)
        # the module's layer is model layer L + k (its name in the checkpoint) for its dropout
        drop = None if dropout is None else jax.random.fold_in(dropout, c.num_layers + k)
        if embedded is None:
            e = layout.embed(params["embed"], tokens[..., k], where)
        else:
            e = embedded[..., k, :]
        e = jaxops.rms_norm(e, p["enorm"], eps=eps, impl=ops.impl)
        prev = jaxops.rms_norm(x, p["hnorm"], eps=eps, impl=ops.impl)
        y = _layers.projection(ops, jnp.concatenate([e, prev], axis=-1), p["eh_proj"], None)
        y, stats = step(y, (p["block"], kind, drop))
        aux = aux + jnp.sum(stats.loss)
        head_k = {**head, "final_norm": p["head_norm"]}
        out.append((head_k, y))
        x = jaxops.rms_norm(y, p["head_norm"], eps=eps, impl=ops.impl)
    return out, aux


def losses(
    layout: Layout,
    params: dict[str, Any],
    head: dict[str, Any],
    h: jax.Array,
    where: _layers.Tokens,
    tokens: jax.Array | None,
    targets: jax.Array,
    gather: bool = True,
    embedded: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(summed cross-entropy per depth [depth], summed MoE aux loss)`` of the MTP modules.

    `tokens`, `targets`: the depths' ``[B, S, depth]`` (:func:`shifted`); the others as in
    :func:`hidden`.
    """
    out, aux = hidden(layout, params, head, h, where, tokens, gather, embedded)
    totals = [layout.losses(head_k, y, targets[..., k])[0] for k, (head_k, y) in enumerate(out)]
    return jnp.stack(totals), aux


def embedded(layout: Layout, table: jax.Array, tokens: jax.Array, where: _layers.Tokens):
    """The depths' input tokens ``[B, S, depth]`` embedded: ``[B, S, depth, D]``, 0 at padding.

    (What a pipeline's last stage reads instead of the embedding table: computed before the
    pipeline, its gradient returned with the targets'.)
    """
    depth = tokens.shape[-1]
    return jnp.stack([layout.embed(table, tokens[..., k], where) for k in range(depth)], axis=2)


def counts(mtp_targets: jax.Array, axes: tuple[str, ...] = ()) -> jax.Array:
    """The counted targets of each depth, float32 ``[depth]`` (at least 1 each).

    `axes`: inside a ``shard_map``, the batch axes the rows are split over (summed over them).
    """
    n = jnp.sum(mtp_targets != _layers.IGNORE_INDEX, axis=(0, 1), dtype=jnp.float32)
    if axes:
        n = jax.lax.psum(n, axes)
    return jnp.maximum(n, 1.0)


def term(layout: Layout, totals: jax.Array, n: jax.Array) -> jax.Array:
    """``lambda / D * sum_k CE_k``: each depth's summed cross-entropy over its count `n`."""
    return layout.mtp_loss_weight / layout.config.mtp_layers * jnp.sum(totals / n)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)
