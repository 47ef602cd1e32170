"""CheckpointManager: numbered steps, async saves, retention and a host-side EMA."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxops._errors import InvalidArgumentError

from ._coordination import _Coordinator, _write_checkpoint
from ._format import CheckpointError, _is_float, _np_dtype
from ._index import INDEX, _load_index, _step_value
from ._io import _read_region, _Reader
from ._plan import _assign, _meta, _Owned, _Snapshot
from ._restore import _restore_leaves, restore
from ._save import _snapshot
from ._tree import _flatten, _prefixed, _target_of


class CheckpointManager:
    """Numbered checkpoints in one directory: async saves, retention and a host-side EMA.

    Step ``s`` lives in ``directory/<s>`` (a :func:`save` checkpoint). Every process creates
    the manager and calls :meth:`save` with the same steps and trees.

    - ``async_save=True``: :meth:`save` returns once this process's own shards are copied to
      host memory; writing and committing run in a background thread. The next :meth:`save`
      waits for the previous one. A failed background save raises on the next call of
      :meth:`save`, :meth:`wait`, :meth:`restore`, :meth:`all_steps` or :meth:`latest_step`.
      The snapshot is a copy, so the caller may donate or overwrite the arrays right away.
    - Retention after each commit: the newest ``max_to_keep`` steps are kept, and every step
      that is a multiple of ``keep_every``; the others are removed (``None``: keep all).
    - ``ema_decay``: the manager keeps an exponential moving average of the saved floating-point
      leaves (those under ``ema_subtree`` when given) on the host, in float32, updated from each
      snapshot in the background: ``ema = decay * ema + (1 - decay) * value``, starting from the
      first snapshot. It costs no device memory: each process averages only the blocks it
      writes. It is saved in the same checkpoint under the ``"ema"`` key prefix; read it with
      ``restore(step, target, ema=True)``. :meth:`restore` of a step that holds an EMA also
      reloads it (with or without ``ema=True``), so the average continues across restarts;
      except with ``target=None`` or a multi-process ``subtree``, which warn.

    Args:
      directory: where the step directories live (created by process 0).
      max_to_keep: how many of the newest steps to keep, or None for all.
      keep_every: also keep every step divisible by this, or None.
      async_save: write in a background thread (see above).
      ema_decay: the EMA decay in [0, 1), or None for no EMA.
      ema_subtree: a "/"-separated key prefix: average only the leaves under it.
      progress: tqdm progress bars (None: only on a terminal).
      timeout: seconds a process waits for the others during a save.

    Example:
      >>> import tempfile, jax, jax.numpy as jnp
      >>> from jaxops.parallel.checkpoint import CheckpointManager
      >>> mgr = CheckpointManager(tempfile.mkdtemp(), max_to_keep=2, ema_decay=0.5)
      >>> for step in range(3):
      ...     mgr.save(step, {"w": jnp.full((4,), float(step))})
      >>> mgr.wait(); mgr.all_steps()
      [1, 2]
      >>> target = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
      >>> mgr.restore(2, target)["w"], mgr.restore(2, target, ema=True)["w"]
      (Array([2., 2., 2., 2.], dtype=float32), Array([1.25, 1.25, 1.25, 1.25], dtype=float32))
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        keep_every: int | None = None,
        async_save: bool = True,
        ema_decay: float | None = None,
        ema_subtree: str | None = None,
        progress: bool | None = None,
        timeout: float = 600.0,
    ):
        op = "jaxops.parallel.checkpoint.CheckpointManager"
        for name, value in (("max_to_keep", max_to_keep), ("keep_every", keep_every)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise InvalidArgumentError(
                    f"{op}: {name} must be None or an int >= 1, got {value!r}"
                )
        if ema_decay is not None and not (
            isinstance(ema_decay, (int, float)) and 0.0 <= float(ema_decay) < 1.0
        ):
            raise InvalidArgumentError(
                f"{op}: ema_decay must be None or a float in [0, 1), got {ema_decay!r}"
            )
        self.directory = Path(directory)
        self.max_to_keep = max_to_keep
        self.keep_every = keep_every
        self.async_save = bool(async_save)
        self.ema_decay = None if ema_decay is None else float(ema_decay)
        self.ema_subtree = ema_subtree.strip("/") if ema_subtree else None
        self.progress = progress
        self.timeout = timeout
        self._ema: dict[tuple[str, tuple[int, ...], tuple[int, ...]], np.ndarray] = {}
        self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="jaxops-checkpoint")
        self._pending: cf.Future | None = None
        if jax.process_index() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for leftover in self.directory.glob(".*.partial"):  # from a crashed save
                shutil.rmtree(leftover, ignore_errors=True)
            for leftover in self.directory.glob(".*.deleting"):
                shutil.rmtree(leftover, ignore_errors=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Waits for a pending save (raising its error) and stops the background thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)

    def step_path(self, step: int) -> Path:
        """The directory of `step`."""
        return self.directory / str(step)

    def wait(self) -> None:
        """Blocks until the pending save is committed; raises the error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _raise_failed(self) -> None:
        if self._pending is not None and self._pending.done():
            self.wait()

    def all_steps(self) -> list[int]:
        """The committed steps, ascending."""
        self._raise_failed()
        if not self.directory.is_dir():
            return []
        return sorted(
            int(p.name)
            for p in self.directory.iterdir()
            if p.name.isdigit() and (p / INDEX).is_file()
        )

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, tree: Any, *, metadata: Mapping[str, Any] | None = None) -> None:
        """Saves `tree` as `step` (asynchronously with ``async_save``).

        Args:
          step: a non-negative int, not saved before.
          tree: as for :func:`save`.
          metadata: JSON-serializable, stored in the index.
        """
        op = "jaxops.parallel.checkpoint.CheckpointManager.save"
        self.wait()
        step = _step_value(op, step, none_ok=False)
        if self.step_path(step).exists():
            raise FileExistsError(f"{op}: step {step} exists in {self.directory}")
        if metadata is not None:
            json.dumps(dict(metadata))
        if self.ema_decay is not None and any(
            k == "ema" or k.startswith("ema/") for k in _flatten(op, tree)[0]
        ):
            raise InvalidArgumentError(
                f"{op}: with ema_decay the tree must not have a top-level 'ema' key"
            )
        snap = _snapshot(op, tree, copy=self.async_save)
        coord = _Coordinator(self.timeout, op)
        if self.async_save:
            self._pending = self._executor.submit(self._write, step, snap, metadata, coord)
        else:
            self._write(step, snap, metadata, coord)

    def _ema_key(self, key: str) -> bool:
        sub = self.ema_subtree
        return sub is None or key == sub or key.startswith(sub + "/")

    def _write(
        self,
        step: int,
        snap: _Snapshot,
        metadata: Mapping[str, Any] | None,
        coord: _Coordinator,
    ) -> None:
        if self.ema_decay is not None:
            self._update_ema(snap)
        _write_checkpoint(
            self.step_path(step),
            snap,
            step=step,
            metadata=metadata,
            progress=self.progress,
            coord=coord,
        )
        if jax.process_index() == 0:
            self._prune()

    def _update_ema(self, snap: _Snapshot) -> None:
        """Folds the snapshot into the host EMA and adds the EMA's blocks to the snapshot."""
        decay = self.ema_decay
        for key, info in list(snap.arrays.items()):
            if self._ema_key(key) and _is_float(_np_dtype(info["dtype"])):
                snap.arrays["ema/" + key] = {"shape": info["shape"], "dtype": "float32"}
        extra = []
        for o in snap.owned:
            if "ema/" + o.key not in snap.arrays:
                continue
            tag = (o.key, o.block.start, o.block.shape)
            value = o.source.astype(np.float32)  # a fresh array (astype copies)
            ema = self._ema.get(tag)
            if ema is None:
                ema = self._ema[tag] = value
            else:
                ema *= decay
                ema += (1.0 - decay) * value
            extra.append(_Owned("ema/" + o.key, o.block, ema))
        snap.owned.extend(extra)

    def _prune(self) -> None:
        steps = self.all_steps()
        keep = set(steps if self.max_to_keep is None else steps[-self.max_to_keep :])
        if self.keep_every is not None:
            keep |= {s for s in steps if s % self.keep_every == 0}
        for s in steps:
            if s not in keep:
                doomed = self.directory / f".{s}.deleting"
                os.rename(self.step_path(s), doomed)  # gone from all_steps at once
                shutil.rmtree(doomed, ignore_errors=True)

    def restore(
        self, step: int | None, target: Any, *, ema: bool = False, subtree: str | None = None
    ) -> Any:
        """Restores `step` (None: the latest) into `target`; see :func:`restore`.

        Args:
          step: the step, or None for the latest.
          target: as for :func:`restore`.
          ema: restore the EMA of the target's leaves instead, cast to the target's dtypes
            (leaves without an EMA, such as integers, get their saved values).
          subtree: as for :func:`restore`.

        With ``ema_decay``, either way the manager reloads the saved EMA of the target's leaves,
        so that the next saves continue it. It cannot with ``target=None`` or, with several
        processes, a ``subtree``: those warn, and the EMA starts again at the next save.
        """
        op = "jaxops.parallel.checkpoint.CheckpointManager.restore"
        self.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"{op}: no checkpoint in {self.directory}")
        path = self.step_path(step)
        if ema:
            if target is None:
                raise InvalidArgumentError(
                    "CheckpointManager.restore: ema=True needs a target (the EMA is restored "
                    "into the target's leaves); got None"
                )
            out = self._restore_ema(path, target, subtree)
        else:
            out = restore(path, target, subtree=subtree, progress=self.progress)
        if self.ema_decay is not None:
            if target is None:
                warnings.warn(
                    "CheckpointManager.restore with target=None does not reload the EMA: the "
                    "next save starts it again from the current values; restore with the "
                    "tree's target to continue it",
                    stacklevel=2,
                )
            elif subtree is not None and jax.process_count() > 1:
                warnings.warn(
                    "CheckpointManager.restore(subtree=...) with several processes does not "
                    "reload the EMA (which process keeps which replicated block depends on the "
                    "whole tree); the next save starts it again for those leaves",
                    stacklevel=2,
                )
            else:
                self._reload_ema(path, subtree, target)
        return out

    def _restore_ema(self, path: Path, target: Any, subtree: str | None) -> Any:
        """The EMA of each target leaf that has one (cast to its dtype), else its saved value."""
        op = "jaxops.parallel.checkpoint.CheckpointManager.restore"
        index = _load_index(path)
        keys, leaves, treedef = _flatten(op, target)
        full, targets = [], []
        for key, leaf in zip(keys, leaves, strict=True):
            shape, dtype, sharding = _target_of(op, key, leaf)
            stored = _prefixed(subtree, key)
            if "ema/" + stored in index["arrays"]:
                full.append("ema/" + stored)
                targets.append((shape, np.dtype(np.float32), sharding))
            else:
                full.append(stored)
                targets.append((shape, dtype, sharding))
        values = _restore_leaves(op, path, index, full, targets, self.progress)
        values = [
            v.astype(_target_of(op, k, leaf)[1]) if k.startswith("ema/") else v
            for v, k, leaf in zip(values, full, leaves, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, values)

    def _reload_ema(self, path: Path, subtree: str | None, target: Any) -> None:
        """Loads the EMA blocks this process will write, as the saved sharding assigns them."""
        index = _load_index(path)
        keys, leaves, _ = _flatten("CheckpointManager.restore", target)
        keys = [_prefixed(subtree, k) for k in keys]
        if not any("ema/" + k in index["arrays"] for k in keys):
            return
        reader = _Reader(path, index)
        try:
            for i, block, _ in _assign([_meta(leaf) for leaf in leaves], jax.process_index()):
                info = index["arrays"].get("ema/" + keys[i])
                if info is not None:
                    self._ema[(keys[i], block.start, block.shape)] = _read_region(
                        reader, "ema/" + keys[i], info, block.start, block.shape
                    )
        finally:
            reader.close()
