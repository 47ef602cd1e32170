"""The block plan: which process writes which block, and which stored bytes a restore needs."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ._format import _np_dtype
from ._index import _block_name


@dataclasses.dataclass(frozen=True)
class _Block:
    """A region of a global array: ``start`` and ``shape`` per dimension."""

    start: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def name(self, key: str, global_shape: tuple[int, ...]) -> str:
        return _block_name(key, list(self.start), list(self.shape), list(global_shape))


def _as_block(index: tuple[slice, ...], shape: tuple[int, ...]) -> _Block:
    starts, sizes = [], []
    for sl, n in zip(index, shape, strict=True):
        lo, hi, _ = sl.indices(n)
        starts.append(lo)
        sizes.append(max(hi - lo, 0))
    return _Block(tuple(starts), tuple(sizes))


@dataclasses.dataclass
class _Owned:
    """A block this process writes: the array key, the block and where its data comes from."""

    key: str
    block: _Block
    source: Any  # a jax shard's data, a numpy array, or (after the snapshot) host bytes


@dataclasses.dataclass
class _Snapshot:
    """What one process writes for one save: its blocks on the host and the array metadata."""

    arrays: dict[str, dict[str, Any]]  # key -> {"shape", "dtype"} for every leaf of the tree
    owned: list[_Owned]  # .source are host numpy arrays


def _assign(
    metas: list[tuple[tuple[int, ...], int, Any]], process_id: int
) -> list[tuple[int, _Block, Any]]:
    """The blocks this process writes: (leaf number, block, device holding it or None).

    `metas` holds (shape, itemsize, sharding or None for host values) per leaf. Every process
    computes the same assignment: a block held by one process is written by it, a block held by
    several (replicated) goes to the least loaded of them, largest blocks first, so the bytes
    are spread evenly; host values are written by process 0.
    """
    load: dict[int, int] = {}
    mine: list[tuple[int, _Block, Any]] = []
    shared: list[tuple[int, int, _Block, dict[int, Any]]] = []
    for i, (shape, itemsize, sharding) in enumerate(metas):
        if sharding is None:
            block = _Block((0,) * len(shape), shape)
            load[0] = load.get(0, 0) + block.size * itemsize
            if process_id == 0:
                mine.append((i, block, None))
            continue
        holders: dict[_Block, dict[int, Any]] = {}
        for device, index in sharding.devices_indices_map(shape).items():
            block = _as_block(index, shape)
            procs = holders.setdefault(block, {})
            if device.process_index not in procs or device.id < procs[device.process_index].id:
                procs[device.process_index] = device
        for block in sorted(holders, key=lambda b: b.start):
            procs = holders[block]
            if len(procs) == 1:
                ((owner, device),) = procs.items()
                load[owner] = load.get(owner, 0) + block.size * itemsize
                if owner == process_id:
                    mine.append((i, block, device))
            else:
                shared.append((i, block.size * itemsize, block, procs))
    for i, nbytes, block, procs in sorted(shared, key=lambda s: (-s[1], s[0], s[2].start)):
        owner = min(procs, key=lambda p: (load.get(p, 0), p))
        load[owner] = load.get(owner, 0) + nbytes
        if owner == process_id:
            mine.append((i, block, procs[owner]))
    mine.sort(key=lambda m: (m[0], m[1].start))
    return mine


def _meta(leaf: Any) -> tuple[tuple[int, ...], int, Any]:
    sharding = getattr(leaf, "sharding", None)
    return tuple(leaf.shape), np.dtype(leaf.dtype).itemsize, sharding


def _plan(keys: list[str], leaves: list[Any], process_id: int) -> list[_Owned]:
    """The blocks this process writes, with the shard (or host array) holding each."""
    owned = []
    for i, block, device in _assign([_meta(leaf) for leaf in leaves], process_id):
        leaf = leaves[i]
        if device is None:
            owned.append(_Owned(keys[i], block, leaf))
        else:
            shard = next(s for s in leaf.addressable_shards if s.device == device)
            owned.append(_Owned(keys[i], block, shard))
    return owned


_SEGMENT_BYTES = 8 << 20  # bytes of a stored block read, verified and scattered as one piece


@dataclasses.dataclass
class _Region:
    """A region of an array this process needs, and how many of its elements were filled."""

    start: tuple[int, ...]
    dest: np.ndarray
    filled: int = 0


@dataclasses.dataclass
class _Segment:
    """Rows [r0, r1) (first dim) of a stored block and the region boxes that lie in them.

    ``boxes`` holds (region, lo, hi): the box in block coordinates, rows clipped to the segment.
    ``lo``/``hi`` are the byte range of the block to read (chunk aligned, spanning every chunk
    the boxes touch) and ``span`` the byte range the buffer covers (also the whole rows).
    """

    key: str
    block: dict[str, Any]
    r0: int
    r1: int
    boxes: list[tuple[_Region, list[int], list[int]]]
    reads: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    span: tuple[int, int] = (0, 0)


def _box_runs(shape: tuple[int, ...], lo: list[int], hi: list[int], itemsize: int):
    """Byte offsets of the contiguous runs of box [lo, hi) in a row-major block, and run length."""
    # The box is contiguous along the trailing dims it covers fully; k is the first dim (from the
    # end) it does not, so each run spans (hi[k] - lo[k]) * prod(shape[k+1:]) elements.
    k = len(shape) - 1
    while k > 0 and lo[k] == 0 and hi[k] == shape[k]:
        k -= 1
    run = (hi[k] - lo[k]) * math.prod(shape[k + 1 :]) * itemsize
    strides = [math.prod(shape[d + 1 :]) * itemsize for d in range(len(shape))]
    grids = np.meshgrid(*[np.arange(lo[d], hi[d]) for d in range(k)], indexing="ij")
    starts = lo[k] * strides[k] + sum(
        (g.reshape(-1).astype(np.int64) * strides[d] for d, g in enumerate(grids)),
        start=np.zeros(1, np.int64),
    )
    return starts, run


def _segments(key: str, info: dict[str, Any], regions: list[_Region], chunk: int):
    """The segments of the stored blocks of one array that overlap `regions`."""
    itemsize = _np_dtype(info["dtype"]).itemsize
    out = []
    for block in info["blocks"]:
        bstart, bshape = tuple(block["start"]), tuple(block["shape"])
        boxes = []
        for region in regions:
            if region.dest.size == 0:
                continue
            shape = region.dest.shape
            lo = [max(a, b) - b for a, b in zip(region.start, bstart, strict=True)]
            hi = [
                min(a + n, b + m) - b
                for a, n, b, m in zip(region.start, shape, bstart, bshape, strict=True)
            ]
            if all(h > low for low, h in zip(lo, hi, strict=True)):
                boxes.append((region, lo or [0], hi or [1]))  # a scalar: a block of one element
        if not boxes:
            continue
        shape = bshape or (1,)
        row = math.prod(shape[1:]) * itemsize
        per = max(1, _SEGMENT_BYTES // max(row, 1))
        first = min(lo[0] for _, lo, _ in boxes)
        last = max(hi[0] for _, _, hi in boxes)
        for r0 in range(first, last, per):
            r1 = min(r0 + per, last)
            clipped = [
                (region, [max(lo[0], r0), *lo[1:]], [min(hi[0], r1), *hi[1:]])
                for region, lo, hi in boxes
                if lo[0] < r1 and hi[0] > r0
            ]
            if not clipped:
                continue
            seg = _Segment(key, block, r0, r1, clipped)
            # The chunks holding bytes of any box, merged into contiguous reads.
            c0, c1 = r0 * row // chunk, -(-r1 * row // chunk)
            need = np.zeros(c1 - c0 + 1, np.int64)
            for _, lo, hi in clipped:
                starts, run = _box_runs(shape, lo, hi, itemsize)
                np.add.at(need, starts // chunk - c0, 1)
                np.add.at(need, (starts + run - 1) // chunk + 1 - c0, -1)
            wanted = np.cumsum(need)[:-1] > 0
            edges = np.flatnonzero(np.diff(np.concatenate([[0], wanted.astype(np.int8), [0]])))
            seg.reads = [
                ((c0 + int(a)) * chunk, min((c0 + int(b)) * chunk, block["nbytes"]))
                for a, b in zip(edges[::2], edges[1::2], strict=True)
            ]
            seg.span = (
                min(seg.reads[0][0], r0 * row),
                max(seg.reads[-1][1], r1 * row),
            )
            out.append(seg)
    return out
