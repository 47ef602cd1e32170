"""The decoder's training step: loss, gradients and an optimizer update in one jitted function.

The parameters, the optimizer state and the gradients are laid out by the decoder's
:class:`~jaxops.models._layout.Layout` (``zero``: ZeRO-1 shards the optimizer state and the
gradients the update reads over the batch axes, ZeRO-3 the parameters too): after the
backward each device keeps its slice of every reduced gradient, updates its slice of the state,
and with ZeRO-1 all-gathers the updated parameters. jax's partitioner inserts those collectives,
except the gradients' with ``grad_reduce="flat"`` and ZeRO-1 (:attr:`Layout.flat_zero`): there
they come reduce-scattered into the shards as flat buffers (:mod:`~jaxops.models._flat`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jaxops._sharding import constrain

from ._layout import Layout

__all__ = ["TrainStep", "apply_update", "train_step"]


class TrainStep:
    """``step(params, opt_state, tokens, targets, **batch) -> (params, opt_state, loss)``.

    A jitted function that runs under the decoder's mesh (``jax.set_mesh``); ``lower`` lowers
    it for abstract arguments (``jax.ShapeDtypeStruct`` s with shardings) without running it.
    The parameters and the optimizer state are donated.
    """

    def __init__(self, mesh: jax.sharding.Mesh, fn: Callable[..., Any]):
        self._mesh = mesh
        self._jitted = jax.jit(fn, donate_argnums=(0, 1))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with jax.set_mesh(self._mesh):
            return self._jitted(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(...).lower`` of the step under the mesh (``.compile()`` it to plan)."""
        with jax.set_mesh(self._mesh):
            return self._jitted.lower(*args, **kwargs)


def apply_update(layout: Layout, optimizer: Any, params: Any, opt_state: Any, grads: Any):
    """``(params, opt_state)`` after ``optimizer.update`` of `grads` (of ``trainable(params)``).

    Laid out by :attr:`Layout.zero`, as :func:`train_step` documents; every step built on the
    decoder (the loss's, post-training's) updates through here.
    """
    params_sharding = layout.shardings()
    state_sharding = layout.optimizer_shardings(optimizer)
    zero_sharding = layout.named(layout.trainable_specs(layout.zero_specs()))
    trained = layout.trainable(params)  # with LoRA the adapters; the rest stays as it is
    if layout.zero >= 1:  # each device keeps the slice of the reduced gradient it updates
        grads = constrain(grads, zero_sharding)
        # and of the parameters (a local slice of replicated ones): the update reads and
        # adds to them shard by shard, as laid out as the optimizer state
        trained = constrain(trained, zero_sharding)
    updates, opt_state = optimizer.update(grads, opt_state, trained)
    trained = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), trained, updates)
    params = layout.with_trained(trained, params)
    return constrain(params, params_sharding), constrain(opt_state, state_sharding)


def train_step(layout: Layout, optimizer: Any, loss_and_grads: Callable[..., Any]) -> TrainStep:
    """One training step with an optax-style `optimizer` (``init`` / ``update``).

    `loss_and_grads`: ``(params, tokens, targets, **batch) -> (loss, grads)``, the batch checked
    (the decoder's; with :attr:`Layout.flat_zero` the gradients come as the ZeRO-1 shards of
    :meth:`Layout.zero_specs`).
    """

    def step(params, opt_state, tokens, targets, **batch):
        loss, grads = loss_and_grads(params, tokens, targets, **batch)
        params, opt_state = apply_update(layout, optimizer, params, opt_state, grads)
        return params, opt_state, loss

    return TrainStep(layout.mesh, step)
