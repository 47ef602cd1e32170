"""The layout of ``stage_params``: model order <-> the round-robin pipeline layout.

Device d of the pipeline axis holds rows ``d V .. d V + V - 1`` of the stacked stage axis; row
``d V + v`` is model stage ``v P + d``. :func:`interleave` and :func:`deinterleave` convert.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxops._errors import InvalidArgumentError

__all__ = ["deinterleave", "interleave"]


def interleave(stage_params: Any, *, num_stages: int, virtual_stages: int) -> Any:
    """Reorders params stacked in model order (stage 0 .. L-1) into the pipeline layout.

    Args:
      stage_params: pytree of arrays stacked on a leading axis of size
        ``L = num_stages * virtual_stages`` in model order.
      num_stages: P, devices on the pipeline axis.
      virtual_stages: V, chunks per device.

    Returns:
      The same pytree with row ``d V + v`` holding model stage ``v P + d``.

    Raises:
      ValueError: a leaf whose leading axis is not ``L``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxops.parallel.pipeline import interleave, deinterleave
      >>> w = jnp.arange(8)
      >>> interleave(w, num_stages=4, virtual_stages=2)
      Array([0, 4, 1, 5, 2, 6, 3, 7], dtype=int32)
      >>> deinterleave(interleave(w, num_stages=4, virtual_stages=2), num_stages=4,
      ...              virtual_stages=2).tolist()
      [0, 1, 2, 3, 4, 5, 6, 7]
    """
    op = "jaxops.parallel.pipeline.interleave"
    return jax.tree.map(lambda a: _regroup(op, a, (virtual_stages, num_stages)), stage_params)


def deinterleave(stage_params: Any, *, num_stages: int, virtual_stages: int) -> Any:
    """Inverse of :func:`interleave`: pipeline layout back to model order.

    Args and Raises as :func:`interleave`; the leading axis of every leaf is in pipeline layout.
    """
    op = "jaxops.parallel.pipeline.deinterleave"
    return jax.tree.map(lambda a: _regroup(op, a, (num_stages, virtual_stages)), stage_params)


def _regroup(op: str, a: Any, split: tuple[int, int]) -> Any:
    """``[A * B, ...] -> [B * A, ...]``: row ``i A + j`` moves to ``j B + i``."""
    if a.shape[0] != split[0] * split[1]:
        raise InvalidArgumentError(
            f"{op}: the stacked stage axis must have size num_stages * virtual_stages = "
            f"{split[0] * split[1]}, got shape {tuple(a.shape)}"
        )
    if split[0] == 1 or split[1] == 1:
        return a
    sharding = getattr(jax.typeof(a), "sharding", None)
    if sharding is not None and any(sharding.spec):  # explicitly sharded: replicate first
        a = jax.reshard(a, NamedSharding(sharding.mesh, P()))
    b = a.reshape(*split, *a.shape[1:])
    return jnp.swapaxes(b, 0, 1).reshape(a.shape)
