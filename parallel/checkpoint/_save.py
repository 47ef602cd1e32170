"""save(): a snapshot of this process's blocks, written and committed."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxops._errors import ArgumentTypeError, InvalidArgumentError, named_errors

from ._coordination import _Coordinator, _write_checkpoint
from ._format import _dtype_name
from ._index import _step_value
from ._io import _to_host
from ._plan import _plan, _Snapshot
from ._tree import _flatten, _prefixed


def _snapshot(op: str, tree: Any, *, copy: bool, prefix: str | None = None) -> _Snapshot:
    keys, leaves, _ = _flatten(op, tree)
    for key in keys:
        if key == "__metadata__" or "[" in key or "]" in key:
            raise InvalidArgumentError(
                f"{op}: leaf key {key!r} is not allowed: keys name the tensors of the files "
                "(part of a sharded array is key[start:end,...]) and '__metadata__' is the "
                "safetensors header's own; expected a key without '[' or ']'"
            )
    arrays: dict[str, dict[str, Any]] = {}
    host_leaves = []
    for key, leaf in zip(keys, leaves, strict=True):
        if not isinstance(leaf, jax.Array):
            if not isinstance(leaf, (np.ndarray, np.generic, int, float, bool)):
                raise ArgumentTypeError(
                    f"{op}: leaf {key!r} must be a jax.Array, numpy array or Python scalar, "
                    f"got {type(leaf).__name__}"
                )
            leaf = np.asarray(leaf)
        host_leaves.append(leaf)
        arrays[_prefixed(prefix, key)] = {
            "shape": list(leaf.shape),
            "dtype": _dtype_name(op, f"leaf {key!r}", leaf.dtype),
        }
    owned = _plan(keys, host_leaves, jax.process_index())
    for o, data in zip(owned, _to_host(owned, copy), strict=True):
        o.source = data
        o.key = _prefixed(prefix, o.key)
    return _Snapshot(arrays, owned)


@named_errors("jaxops.parallel.checkpoint.save")
def save(
    path: str | os.PathLike,
    tree: Any,
    *,
    step: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    timeout: float = 600.0,
) -> None:
    """Saves a tree of (sharded) arrays as a checkpoint directory, atomically.

    Every process calls it with the same tree (same structure, shapes, dtypes and shardings);
    each writes the blocks it owns. It returns when the checkpoint is committed.

    Args:
      path: the checkpoint directory to create; it must not exist. Its parent is created.
      tree: a pytree whose leaves are ``jax.Array`` (any sharding, also spanning processes),
        numpy arrays or Python scalars (those are written by process 0). Dtypes: bool, int8-64,
        uint8-64, float16, bfloat16, float32, float64, float8_e4m3fn, float8_e5m2. Tree keys
        are joined with "/" (``{"a": [x, y]}`` stores ``a/0`` and ``a/1``).
      step: a non-negative integer (Python or numpy) stored in the index, or None.
      metadata: a JSON-serializable mapping stored in the index (see :func:`describe`).
      progress: a tqdm progress bar for saves longer than a second; ``None`` shows it only when
        stderr is a terminal.
      timeout: seconds a process waits for the others before failing.

    Raises:
      FileExistsError: `path` exists.
      TypeError: a leaf has an unsupported type or dtype.
      ValueError: two leaves map to the same key, a key part contains "/", a key contains "["
        or "]" or is "__metadata__", or `step` is not a non-negative integer.
      CheckpointError: another process failed; nothing was committed.

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> from jaxops.parallel import checkpoint
      >>> d = tempfile.mkdtemp()
      >>> checkpoint.save(f"{d}/ckpt", {"w": jnp.ones((2, 3), jnp.bfloat16)}, step=7)
      >>> checkpoint.describe(f"{d}/ckpt")["arrays"]
      {'w': {'shape': (2, 3), 'dtype': 'bfloat16'}}
    """
    step = _step_value("jaxops.parallel.checkpoint.save", step, none_ok=True)
    if metadata is not None:
        json.dumps(dict(metadata))  # raises TypeError early for non-JSON metadata
    snap = _snapshot("jaxops.parallel.checkpoint.save", tree, copy=False)
    coord = _Coordinator(timeout)
    _write_checkpoint(
        Path(path), snap, step=step, metadata=metadata, progress=progress, coord=coord
    )
