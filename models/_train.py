"""The decoder's training step: loss, gradients and an optimizer update in one jitted function.

The parameters, the optimizer state and the gradients are laid out by
:class:`~jaxops.models._layout.Layout` (``zero``: ZeRO-1 shards the optimizer state and the
gradients the update reads over the batch axes, ZeRO-3 the parameters too): after the
backward each device keeps its slice of every reduced gradient, updates its slice of the state,
and with ZeRO-1 all-gathers the updated parameters. jax's partitioner inserts those collectives,
except the gradients' with ``grad_reduce="flat"`` and ZeRO-1 (``MoEDecoder._flat_zero``):
there they come reduce-scattered into the shards as flat buffers (:mod:`~jaxops.models._flat`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from jaxops._sharding import constrain

if TYPE_CHECKING:
    from ._decoder import MoEDecoder

__all__ = ["TrainStep", "train_step"]


class TrainStep:
    """``step(params, opt_state, tokens, targets, **batch) -> (params, opt_state, loss)``.

    A jitted function that runs under the decoder's mesh (``jax.set_mesh``); ``lower`` lowers
    it for abstract arguments (``jax.ShapeDtypeStruct`` s with shardings) without running it.
    The parameters and the optimizer state are donated.
    """

    def __init__(self, model: MoEDecoder, fn: Callable[..., Any]):
        self._mesh = model.mesh
        self._jitted = jax.jit(fn, donate_argnums=(0, 1))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with jax.set_mesh(self._mesh):
            return self._jitted(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(...).lower`` of the step under the mesh (``.compile()`` it to plan)."""
        with jax.set_mesh(self._mesh):
            return self._jitted.lower(*args, **kwargs)


def train_step(model: MoEDecoder, optimizer: Any) -> TrainStep:
    """One training step of `model` with an optax-style `optimizer` (``init`` / ``update``)."""
    params_sharding = model.shardings()
    state_sharding = model.optimizer_shardings(optimizer)
    zero_sharding = model.named(model.zero_specs())

    def step(params, opt_state, tokens, targets, **batch):
        if model._flat_zero:  # the gradients come reduce-scattered into the ZeRO-1 shards
            loss, grads = model._zero_loss_and_grads(params, tokens, targets, **batch)
        else:
            loss, grads = model.loss_and_grads(params, tokens, targets, **batch)
        if model.zero >= 1:  # each device keeps the slice of the reduced gradient it updates
            grads = constrain(grads, zero_sharding)
            # and of the parameters (a local slice of replicated ones): the update reads and
            # adds to them shard by shard, as laid out as the optimizer state
            params = constrain(params, zero_sharding)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
        return constrain(params, params_sharding), constrain(opt_state, state_sharding), loss

    return TrainStep(model, step)
