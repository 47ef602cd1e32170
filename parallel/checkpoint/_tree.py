"""Tree keys: leaves named by their "/"-joined paths, and restore targets."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxops._errors import ArgumentTypeError, InvalidArgumentError


def _key_part(entry: Any) -> str:
    if isinstance(entry, jax.tree_util.DictKey):
        return str(entry.key)
    if isinstance(entry, jax.tree_util.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return entry.name
    if isinstance(entry, jax.tree_util.FlattenedIndexKey):
        return str(entry.key)
    return str(entry)


def _flatten(op: str, tree: Any) -> tuple[list[str], list[Any], Any]:
    """Leaves of `tree` with their "/"-joined keys, and the treedef."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keys, leaves = [], []
    seen: set[str] = set()
    for path, leaf in with_paths:
        parts = [_key_part(p) for p in path]
        for part in parts:
            if not part or "/" in part:
                raise InvalidArgumentError(
                    f"{op}: tree key part {part!r} (at {jax.tree_util.keystr(path)}) must be "
                    "non-empty and must not contain '/'"
                )
        key = "/".join(parts) if parts else "value"
        if key in seen:
            raise InvalidArgumentError(f"{op}: two leaves have the key {key!r}")
        seen.add(key)
        keys.append(key)
        leaves.append(leaf)
    return keys, leaves, treedef


def _prefixed(subtree: str | None, key: str) -> str:
    return f"{subtree.strip('/')}/{key}" if subtree else key


def _target_of(op: str, key: str, leaf: Any) -> tuple[tuple[int, ...], np.dtype, Any]:
    """(shape, dtype, sharding or None for a numpy result) of a restore target leaf."""
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = leaf.sharding
        if sharding is None:
            if jax.process_count() > 1:
                raise InvalidArgumentError(
                    f"{op}: target {key!r} has no sharding; with several processes every "
                    "target needs one"
                )
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return tuple(leaf.shape), np.dtype(leaf.dtype), sharding
    if isinstance(leaf, (np.ndarray, np.generic)):
        return tuple(leaf.shape), leaf.dtype.newbyteorder("="), None  # results in native order
    raise ArgumentTypeError(
        f"{op}: target leaf {key!r} must be a jax.ShapeDtypeStruct, jax.Array or numpy array, "
        f"got {type(leaf).__name__}"
    )
