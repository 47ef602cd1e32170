"""Sharded checkpoints in the safetensors format, with resharding restore, async save and an EMA.

A checkpoint is a directory holding

- ``data-<p>-of-<n>.safetensors``: one file per process ``p`` that owns data (valid safetensors
  files: ``safetensors.safe_open`` reads them), holding the array blocks that process wrote;
- ``index.json``, written last by process 0: for every array its tree key, global shape and
  dtype, and for every stored block the region of the array it covers, its file, byte offset and
  CRC-32C checksums of its 1 MiB chunks; plus the step, the caller's metadata and the format
  version.

Each array block is written once. A block held by devices of one process is written by that
process; a replicated block is written by one of its holders, chosen deterministically so that
the bytes are spread evenly over the processes. No pickle anywhere: loading reads JSON and raw
little-endian bytes and never runs code.

Commit is atomic. Every process writes into ``.<name>.partial`` beside the final directory and
flushes (``fsync``) its file; process 0 waits for all of them (over ``jax.distributed``'s
key-value store), writes the index, flushes it and renames the directory into place. A crash
at any moment leaves either no checkpoint under the name or a complete one; a leftover
``.partial`` directory is never read and the next save of that name removes it.

Restore builds each process's target shards by reading only the byte ranges of stored blocks
that overlap them (rounded out to 1 MiB checksum chunks, every chunk read is verified), so it
reshards freely: another mesh, device count or process count, sharded to replicated and back.

Functions: :func:`save`, :func:`restore`, :func:`describe`, :class:`CheckpointManager` (steps,
retention, async save, host EMA), :func:`export_safetensors` / :func:`import_safetensors`
(Hugging Face layouts, with declarative :class:`Rule` name maps; the maps of published models,
such as ``jaxops.models.llama_name_map``, live in :mod:`jaxops.models`), :func:`hf_target` (an
import target, with shardings, built from the files' headers) and :func:`hf_tensors` (the
tensors of a Hugging Face checkpoint, from its headers). Every exception it raises for a
checkpoint is a :class:`CheckpointError` (a ``jaxops.JaxopsError`` and a ``RuntimeError``).

Example:
  >>> import tempfile, jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> from jaxops.parallel import checkpoint
  >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
  >>> w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data", "model")))
  >>> d = tempfile.mkdtemp()
  >>> checkpoint.save(f"{d}/step_1", {"w": w, "step": np.int32(1)}, step=1)
  >>> other = jax.make_mesh((4, 2), ("data", "model"))
  >>> target = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32,
  ...                                     sharding=NamedSharding(other, P(None, "data")))}
  >>> out = checkpoint.restore(f"{d}/step_1", target)
  >>> bool(np.array_equal(out["w"], w)), out["w"].sharding.spec
  (True, P(None, 'data'))

Modules, one concern each (lower ones never import higher ones):

- ``_format``: the safetensors format (dtype codes, headers, their validation);
- ``_index``: ``index.json`` (loading, validation, file names);
- ``_tree``: tree keys and restore targets;
- ``_plan``: which process writes which block, which stored bytes a restore needs;
- ``_io``: writing files with chunk CRCs, verified reads, buffers and threads;
- ``_coordination``: processes agreeing over ``jax.distributed``, the atomic commit;
- ``_save`` / ``_restore``: :func:`save`, :func:`restore`, :func:`describe`;
- ``_manager``: :class:`CheckpointManager`;
- ``_rules``, ``_hf_export``, ``_hf_import``, ``_hf_target``: the name-map Rule, Hugging Face
  export, import (and the header index) and import targets.
"""

from ._format import CheckpointError
from ._hf_export import export_safetensors
from ._hf_import import HFTensor, hf_tensors, import_safetensors
from ._hf_target import hf_target
from ._manager import CheckpointManager
from ._restore import describe, restore
from ._rules import Codec, Rule
from ._save import save

__all__ = [
    "Codec",
    "CheckpointError",
    "CheckpointManager",
    "HFTensor",
    "Rule",
    "describe",
    "export_safetensors",
    "hf_target",
    "hf_tensors",
    "import_safetensors",
    "restore",
    "save",
]

_MOVED = {"LLAMA_NAME_MAP", "llama_name_map"}


def __getattr__(name: str):
    # The Llama name map moved to jaxops.models (every published model's map in one module).
    # Deprecated alias for one release: the only reference from this tier to the one above, made
    # on first use of the old name, never at import.
    if name in _MOVED:
        import warnings

        warnings.warn(
            f"jaxops.parallel.checkpoint.{name} moved to jaxops.models.{name}; the old name goes "
            "in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        from jaxops.models import _names

        return getattr(_names, name)
    raise AttributeError(f"module 'jaxops.parallel.checkpoint' has no attribute {name!r}")
