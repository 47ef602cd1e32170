"""Sequence packing for fine-tuning: many token sequences into a few fixed-length rows.

:func:`pack_sequences` bin-packs whole documents into ``[B, S]`` rows (first-fit decreasing by
default) and returns a :class:`PackedBatch`: the tokens, the already-shifted targets (the next
token of the same document, or :data:`IGNORE_INDEX`), the segment ids and the positions that
``MoEDecoder.loss(params, **batch.model_inputs())`` takes. Per-token loss masks give the
supervised fine-tuning convention (prompt tokens 0, response tokens 1).

Host-side NumPy only: nothing here imports jax. A packed batch is built once per step on the
host and then placed on the mesh (``jax.device_put``).

Example:
  >>> from jaxops.models._packing import pack_sequences
  >>> batch = pack_sequences([[5, 6, 7], [8, 9], [1, 2, 3, 4]], seq_len=6,
  ...                        loss_masks=[[0, 1, 1], [1, 1], [0, 0, 1, 1]])
  >>> batch
  PackedBatch(rows=2, seq_len=6, num_sequences=3, fill_ratio=0.7500)
  >>> batch.tokens
  array([[1, 2, 3, 4, 8, 9],
         [5, 6, 7, 0, 0, 0]], dtype=int32)
  >>> batch.targets
  array([[-100,    3,    4, -100,    9, -100],
         [   6,    7, -100, -100, -100, -100]], dtype=int32)
  >>> batch.segment_ids
  array([[1, 1, 1, 1, 2, 2],
         [1, 1, 1, 0, 0, 0]], dtype=int32)
  >>> batch.positions
  array([[0, 1, 2, 3, 0, 1],
         [0, 1, 2, 0, 0, 0]], dtype=int32)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jaxops._errors import ArgumentTypeError, InvalidArgumentError, named_errors

__all__ = ["IGNORE_INDEX", "PACKING_ORDERS", "PackedBatch", "pack_sequences"]

#: The target value the loss ignores (transformers' ``ignore_index``): padding, the last token of
#: every document and tokens whose next token is masked out of the loss.
IGNORE_INDEX = -100

#: The ``order=`` values :func:`pack_sequences` takes.
PACKING_ORDERS = ("first_fit_decreasing", "in_order")

_OP = "jaxops.models.pack_sequences"
_INT32_MAX = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class PackedBatch:
    """Documents packed into ``B`` rows of ``S`` tokens, made by :func:`pack_sequences`.

    Every array is NumPy ``int32 [B, S]``. Padding slots hold ``tokens = pad_id``,
    ``targets = IGNORE_INDEX``, ``segment_ids = 0`` and ``positions = 0``.

    Attributes:
      tokens: the input token ids.
      targets: ``targets[b, i]`` is the token to predict at ``[b, i]`` (already shifted): the next
        token of the same document where its loss mask is set, else :data:`IGNORE_INDEX`
        (always at a document's last token and at padding).
      segment_ids: the documents of a row numbered ``1, 2, ...`` in the order they sit in the
        row; 0 at padding.
      positions: each token's position in its document, ``0 .. len - 1``; 0 at padding.
      fill_ratio: real (non-padding) tokens / ``B * S``; 0.0 when ``B == 0``.
      num_sequences: the number of documents packed (empty input sequences are not counted).
    """

    tokens: np.ndarray
    targets: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    fill_ratio: float
    num_sequences: int

    def model_inputs(self) -> dict[str, np.ndarray]:
        """The keyword arguments of ``MoEDecoder.loss`` after ``params``.

        Returns:
          ``{"tokens", "targets", "segment_ids", "positions"}``, each NumPy ``int32 [B, S]``
          (the arrays themselves, not copies): ``model.loss(params, **batch.model_inputs())``.
        """
        return {
            "tokens": self.tokens,
            "targets": self.targets,
            "segment_ids": self.segment_ids,
            "positions": self.positions,
        }

    @property
    def num_targets(self) -> int:
        """The number of tokens the loss counts (targets other than :data:`IGNORE_INDEX`)."""
        return int(np.count_nonzero(self.targets != IGNORE_INDEX))

    def __repr__(self) -> str:
        rows, seq_len = self.tokens.shape
        return (
            f"PackedBatch(rows={rows}, seq_len={seq_len}, num_sequences={self.num_sequences}, "
            f"fill_ratio={self.fill_ratio:.4f})"
        )


def _int_arg(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ArgumentTypeError(
            f"{name} must be an int >= {low}, got {type(value).__name__} {value!r}"
        )
    if not low <= value <= _INT32_MAX:
        raise InvalidArgumentError(f"{name} must be an int in [{low}, {_INT32_MAX}], got {value}")
    return int(value)


def _as_1d(name: str, value: Any, what: str) -> np.ndarray:
    """`value` as a 1-D NumPy array, or an error naming `name`."""
    array = np.asarray(value)
    if array.ndim != 1:
        raise InvalidArgumentError(
            f"{name} must be a 1-D sequence of {what}, got shape {array.shape}"
            + (" (pass a list of sequences, not one sequence)" if array.ndim == 0 else "")
        )
    return array


def _read_sequences(sequences: Iterable[Any]) -> list[np.ndarray]:
    """The sequences as 1-D int64 arrays; integer dtypes only, every id in ``[0, 2**31)``."""
    if isinstance(sequences, str | bytes) or not isinstance(sequences, Iterable):
        raise ArgumentTypeError(
            "sequences must be a sequence of 1-D token id sequences, "
            f"got {type(sequences).__name__}"
        )
    arrays = []
    for i, seq in enumerate(sequences):
        array = _as_1d(f"sequences[{i}]", seq, "token ids")
        if array.size == 0:
            array = np.zeros(0, np.int64)
        elif array.dtype.kind not in "iu":
            raise ArgumentTypeError(
                f"sequences[{i}] must hold integer token ids, got dtype {array.dtype}"
            )
        elif array.dtype == np.uint64 and array.max() > _INT32_MAX:
            raise InvalidArgumentError(
                f"sequences[{i}] has token id {array.max()}, more than int32 holds ({_INT32_MAX})"
            )
        arrays.append(array.astype(np.int64, copy=False))
    return arrays


def _read_masks(loss_masks: Iterable[Any], lengths: np.ndarray) -> list[np.ndarray]:
    """The loss masks as 1-D bool arrays, one per sequence and as long as it."""
    if isinstance(loss_masks, str | bytes) or not isinstance(loss_masks, Iterable):
        raise ArgumentTypeError(
            f"loss_masks must be None or one 0/1 sequence per sequence, "
            f"got {type(loss_masks).__name__}"
        )
    masks = [_as_1d(f"loss_masks[{i}]", m, "0/1 flags") for i, m in enumerate(loss_masks)]
    if len(masks) != len(lengths):
        raise InvalidArgumentError(
            f"loss_masks must have one mask per sequence ({len(lengths)}), got {len(masks)}"
        )
    for i, mask in enumerate(masks):
        if mask.size != lengths[i]:
            raise InvalidArgumentError(
                f"loss_masks[{i}] must be as long as sequences[{i}] ({lengths[i]}), "
                f"got length {mask.size}"
            )
        if mask.size and mask.dtype.kind not in "biu":
            raise ArgumentTypeError(
                f"loss_masks[{i}] must hold 0/1 or bools, got dtype {mask.dtype}"
            )
        if mask.dtype.kind in "iu" and ((mask != 0) & (mask != 1)).any():
            bad = mask[(mask != 0) & (mask != 1)][0]
            raise InvalidArgumentError(f"loss_masks[{i}] must hold 0/1 or bools, got value {bad}")
        masks[i] = mask.astype(bool, copy=False)
    return masks


def _first_fit_decreasing(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """First-fit decreasing: each length into the lowest row with room, longest first.

    Documents of equal length are placed together, in input order: first fit puts them into the
    lowest row with room until it is full (``room // length`` of them), then into the next, so a
    whole group is placed by one cumulative sum over the rows instead of one search per
    document. Same result as the document-at-a-time loop, at O(distinct lengths * rows).

    Args:
      lengths: ``int64 [N]``, each in ``[1, seq_len]``.
      seq_len: the row length.

    Returns:
      ``(row, rank)``: ``int64 [N]`` each document's row, and its placement rank (the order
      first fit places them: by decreasing length, ties in input order).
    """
    n = lengths.size
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.argsort(-lengths, kind="stable")
    sorted_lengths = lengths[order]
    rank = np.empty(n, np.int64)
    rank[order] = np.arange(n)
    row = np.empty(n, np.int64)
    room = np.empty(n, np.int64)  # room[r]: free slots of row r (at most n rows)
    num_rows = 0
    live = np.zeros(0, np.int64)  # the rows, ascending, that can still take the shortest document
    shortest = int(sorted_lengths[-1])
    starts = np.flatnonzero(np.r_[True, sorted_lengths[1:] != sorted_lengths[:-1]])
    for start, end in zip(starts.tolist(), [*starts[1:].tolist(), n], strict=True):
        length = int(sorted_lengths[start])
        count = end - start
        fits = np.cumsum(room[live] // length)
        taken = min(count, int(fits[-1])) if live.size else 0
        row[order[start : start + taken]] = live[np.searchsorted(fits, np.arange(taken), "right")]
        room[live] -= length * np.diff(np.minimum(fits, taken), prepend=0)
        left = count - taken
        per_row = seq_len // length
        new = -(-left // per_row)
        row[order[start + taken : end]] = num_rows + np.arange(left) // per_row
        room[num_rows : num_rows + new] = seq_len - length * per_row
        if new:
            room[num_rows + new - 1] = seq_len - length * (left - per_row * (new - 1))
        live = np.r_[live, np.arange(num_rows, num_rows + new)]
        live = live[room[live] >= shortest]
        num_rows += new
    return row, rank


def _in_order(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Next fit in input order: a new row when the next document does not fit the current one."""
    row = np.empty(lengths.size, np.int64)
    current, used = 0, 0
    for i, length in enumerate(lengths.tolist()):
        if used + length > seq_len:
            current, used = current + 1, 0
        row[i] = current
        used += length
    return row, np.arange(lengths.size)


@named_errors(_OP)
def pack_sequences(
    sequences: Sequence[Sequence[int] | np.ndarray],
    seq_len: int,
    *,
    loss_masks: Sequence[Sequence[int] | Sequence[bool] | np.ndarray] | None = None,
    num_rows: int | None = None,
    row_multiple: int = 1,
    pad_id: int = 0,
    truncate: bool = False,
    order: str = "first_fit_decreasing",
) -> PackedBatch:
    """Packs whole token sequences into fixed-length rows for the causal LM loss.

    Each non-empty sequence becomes one document, whole in one row. Targets are shifted here:
    at token ``j`` of a document the target is its token ``j + 1`` where
    ``loss_masks[i][j + 1]`` is set, else :data:`IGNORE_INDEX`; a document's last token has no
    target and its first token is never one (``loss_masks[i][0]`` is not read). The packing is
    deterministic: the same input gives the same arrays.

    Args:
      sequences: ``N`` 1-D sequences (lists, tuples or NumPy arrays) of integer token ids in
        ``[0, 2**31)``. Empty sequences are skipped: they hold no token and no target, take no
        room and are not counted in ``num_sequences``.
      seq_len: ``S``, the row length (>= 1).
      loss_masks: None (every next token is a target), or one 0/1 or bool sequence per
        sequence, as long as it: ``loss_masks[i][j]`` says whether token ``j`` of sequence
        ``i`` is predicted (SFT: 0 on the prompt, 1 on the response).
      num_rows: ``B``. None: as many rows as the packing needs, rounded up to a multiple of
        `row_multiple` (0 rows for no tokens). An int: exactly that many rows (the rows the
        packing does not need are all padding); it must be a multiple of `row_multiple`.
      row_multiple: None-`num_rows` rounding (>= 1), e.g. the data-parallel size of the mesh
        so that ``B`` divides evenly over it.
      pad_id: the token id of padding slots (>= 0).
      truncate: False: a sequence longer than `seq_len` raises ValueError. True: it keeps its
        first `seq_len` tokens (and mask entries); its last kept token then has no target.
      order: how documents go into rows, one of :data:`PACKING_ORDERS`:
        ``"first_fit_decreasing"`` (longest first, each into the lowest row with room; ties in
        input order; documents sit in a row in that placement order) or ``"in_order"`` (input
        order, a new row whenever the next document does not fit the current one; keeps the
        documents in input order, at a lower fill ratio).

    Returns:
      A :class:`PackedBatch` of NumPy ``int32 [B, S]`` arrays.

    Raises:
      TypeError: an argument of the wrong type, a sequence that is not of integers, a mask that
        is not 0/1 or bool.
      ValueError: a negative (or > int32) token id (naming the sequence and the value), a
        sequence longer than `seq_len` without `truncate` (naming it and its length), a mask of
        the wrong length or with other values, `num_rows` too small (saying how many rows the
        sequences need) or not a multiple of `row_multiple`, an unknown `order`.

    Example:
      >>> from jaxops.models._packing import pack_sequences
      >>> batch = pack_sequences([[3, 4, 5], [6, 7]], seq_len=4, row_multiple=4)
      >>> batch.tokens.shape, batch.num_sequences, batch.fill_ratio
      ((4, 4), 2, 0.3125)
      >>> batch.targets[:2]
      array([[   4,    5, -100, -100],
             [   7, -100, -100, -100]], dtype=int32)
    """
    seq_len = _int_arg("seq_len", seq_len, 1)
    row_multiple = _int_arg("row_multiple", row_multiple, 1)
    pad_id = _int_arg("pad_id", pad_id, 0)
    if num_rows is not None:
        num_rows = _int_arg("num_rows", num_rows, 0)
        if num_rows % row_multiple:
            raise InvalidArgumentError(
                f"num_rows must be a multiple of row_multiple={row_multiple}, got {num_rows}"
            )
    if not isinstance(truncate, bool | np.bool_):
        raise ArgumentTypeError(
            f"truncate must be a bool, got {type(truncate).__name__} {truncate!r}"
        )
    if order not in PACKING_ORDERS:
        raise InvalidArgumentError(f"order must be one of {PACKING_ORDERS}, got {order!r}")

    arrays = _read_sequences(sequences)
    lengths = np.array([a.size for a in arrays], np.int64)
    masks = None if loss_masks is None else _read_masks(loss_masks, lengths)
    if (lengths > seq_len).any():
        if not truncate:
            i = int(np.argmax(lengths > seq_len))
            raise InvalidArgumentError(
                f"sequences[{i}] has {lengths[i]} tokens, more than seq_len={seq_len} "
                "(pass truncate=True to keep its first seq_len tokens)"
            )
        arrays = [a[:seq_len] for a in arrays]
        masks = None if masks is None else [m[:seq_len] for m in masks]
        lengths = np.minimum(lengths, seq_len)

    kept = np.flatnonzero(lengths)
    lengths = lengths[kept]
    packer = _first_fit_decreasing if order == "first_fit_decreasing" else _in_order
    row, rank = packer(lengths, seq_len)
    needed = int(row.max()) + 1 if row.size else 0
    if num_rows is None:
        num_rows = -(-needed // row_multiple) * row_multiple
    elif needed > num_rows:
        raise InvalidArgumentError(
            f"the sequences need {needed} rows of seq_len={seq_len} (order={order!r}), "
            f"got num_rows={num_rows}"
        )

    # Documents in layout order: by row, then by placement within the row. A row's documents
    # sit contiguously from column 0, so the real tokens in row-major order are the documents'
    # tokens concatenated in layout order, and a boolean mask places them.
    layout = np.lexsort((rank, row))
    doc_len, doc_row = lengths[layout], row[layout]
    doc_end = np.cumsum(doc_len)
    doc_start = doc_end - doc_len  # in the concatenated tokens
    first = np.r_[True, doc_row[1:] != doc_row[:-1]] if layout.size else np.zeros(0, bool)
    doc_col = doc_start - np.maximum.accumulate(np.where(first, doc_start, 0))
    doc_index = np.arange(layout.size)
    segment = doc_index - np.maximum.accumulate(np.where(first, doc_index, 0)) + 1

    placed = kept[layout].tolist()  # the input index of each document in layout order
    flat_tokens = np.concatenate([arrays[i] for i in placed] or [np.zeros(0, np.int64)])
    if flat_tokens.size and (flat_tokens.min() < 0 or flat_tokens.max() > _INT32_MAX):
        k = int(np.argmax((flat_tokens < 0) | (flat_tokens > _INT32_MAX)))
        d = int(np.searchsorted(doc_end, k, "right"))
        raise InvalidArgumentError(
            f"sequences[{placed[d]}] has token id {flat_tokens[k]} at index "
            f"{k - doc_start[d]}; token ids must be in [0, {_INT32_MAX}]"
        )

    fill = np.bincount(doc_row, weights=doc_len, minlength=num_rows).astype(np.int64)
    columns = np.arange(seq_len, dtype=np.int32)
    real = columns < fill[:, None]  # [B, S]
    tokens = np.full((num_rows, seq_len), pad_id, np.int32)
    tokens[real] = flat_tokens
    segment_ids = np.zeros((num_rows, seq_len), np.int32)
    segment_ids[real] = np.repeat(segment.astype(np.int32), doc_len)
    positions = np.zeros((num_rows, seq_len), np.int32)
    positions[real] = np.repeat(doc_col.astype(np.int32), doc_len)  # the document's first column
    np.subtract(columns, positions, out=positions, where=real)
    # Token i predicts token i + 1 where both are of the same document and i + 1 is a target.
    is_target = segment_ids[:, 1:] == segment_ids[:, :-1]
    is_target &= real[:, 1:]
    if masks is not None:
        mask = np.zeros((num_rows, seq_len), bool)
        mask[real] = np.concatenate([masks[i] for i in placed] or [np.zeros(0, bool)])
        is_target &= mask[:, 1:]
    targets = np.full((num_rows, seq_len), IGNORE_INDEX, np.int32)
    np.copyto(targets[:, :-1], tokens[:, 1:], where=is_target)

    return PackedBatch(
        tokens=tokens,
        targets=targets,
        segment_ids=segment_ids,
        positions=positions,
        fill_ratio=flat_tokens.size / (num_rows * seq_len) if num_rows else 0.0,
        num_sequences=int(layout.size),
    )
