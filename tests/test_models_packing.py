"""jaxops.models.pack_sequences: documents packed into rows for the fine-tuning loss.

Exact (integer) checks against a reference: unpacking every row by segment id gives back every
input sequence exactly once, with its targets (the next token where the loss mask says so, else
-100) and positions 0 .. len - 1; first-fit decreasing against a document-at-a-time loop; every
error; hypothesis fuzzing of the invariants.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jaxops.models import _packing
from jaxops.models._packing import IGNORE_INDEX, PackedBatch, pack_sequences

PREFIX = r"^jaxops\.models\.pack_sequences: "


def expected_doc(seq, mask, seq_len, truncate):
    """The (tokens, targets) one input sequence must come back as, or None when it is skipped."""
    seq = [int(t) for t in seq]
    mask = [True] * len(seq) if mask is None else [bool(m) for m in mask]
    if truncate:
        seq, mask = seq[:seq_len], mask[:seq_len]
    if not seq:
        return None
    targets = [seq[j + 1] if mask[j + 1] else IGNORE_INDEX for j in range(len(seq) - 1)]
    return tuple(seq), (*targets, IGNORE_INDEX)


def unpack(batch: PackedBatch, pad_id: int = 0):
    """Every document of the batch as (row, tokens, targets); checks the row layout on the way."""
    docs = []
    for b in range(batch.tokens.shape[0]):
        seg = batch.segment_ids[b]
        real = seg != 0
        n = int(real.sum())
        assert real[:n].all() and not real[n:].any(), "padding only at the row's end"
        assert (batch.tokens[b, n:] == pad_id).all()
        assert (batch.targets[b, n:] == IGNORE_INDEX).all()
        assert (batch.positions[b, n:] == 0).all()
        if n:
            assert seg[0] == 1 and set(np.diff(seg[:n]).tolist()) <= {0, 1}, "1, 2, ... in order"
        for s in range(1, int(seg.max(initial=0)) + 1):
            idx = np.flatnonzero(seg == s)
            np.testing.assert_array_equal(batch.positions[b, idx], np.arange(idx.size))
            docs.append(
                (b, tuple(batch.tokens[b, idx].tolist()), tuple(batch.targets[b, idx].tolist()))
            )
    return docs


def check(sequences, seq_len, masks=None, *, truncate=False, pad_id=0, **kw):
    """pack_sequences against the reference; returns the batch and its documents."""
    batch = pack_sequences(
        sequences, seq_len, loss_masks=masks, truncate=truncate, pad_id=pad_id, **kw
    )
    for a in (batch.tokens, batch.targets, batch.segment_ids, batch.positions):
        assert a.dtype == np.int32 and a.shape == batch.tokens.shape
        assert a.shape[1] == seq_len
    docs = unpack(batch, pad_id)
    want = [
        expected_doc(s, None if masks is None else masks[i], seq_len, truncate)
        for i, s in enumerate(sequences)
    ]
    want = [w for w in want if w is not None]
    assert collections.Counter((t, g) for _, t, g in docs) == collections.Counter(want)
    assert batch.num_sequences == len(want)
    real = sum(len(t) for t, _ in want)
    rows = batch.tokens.shape[0]
    assert batch.fill_ratio == (real / (rows * seq_len) if rows else 0.0)
    assert batch.num_targets == sum(g != IGNORE_INDEX for _, g in want for g in g)
    return batch, docs


def random_input(rng, n, max_len, with_masks=True):
    lens = rng.integers(0, max_len + 1, n)
    seqs = [rng.integers(0, 1000, k) for k in lens]
    masks = [rng.integers(0, 2, k) for k in lens] if with_masks else None
    return seqs, masks


@pytest.mark.parametrize("order", _packing.PACKING_ORDERS)
@pytest.mark.parametrize("seed", range(4))
def test_unpack_recovers_every_sequence(seed, order):
    rng = np.random.default_rng(seed)
    seqs, masks = random_input(rng, 60, 40, with_masks=seed % 2 == 0)
    check(seqs, 48, masks, order=order)


def test_known_values():
    batch = pack_sequences(
        [[5, 6, 7], [8, 9], [1, 2, 3, 4]], 6, loss_masks=[[0, 1, 1], [1, 1], [0, 0, 1, 1]]
    )
    np.testing.assert_array_equal(batch.tokens, [[1, 2, 3, 4, 8, 9], [5, 6, 7, 0, 0, 0]])
    np.testing.assert_array_equal(
        batch.targets, [[-100, 3, 4, -100, 9, -100], [6, 7, -100, -100, -100, -100]]
    )
    np.testing.assert_array_equal(batch.segment_ids, [[1, 1, 1, 1, 2, 2], [1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(batch.positions, [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 0]])
    assert batch.fill_ratio == 0.75 and batch.num_sequences == 3 and batch.num_targets == 5


def naive_first_fit_decreasing(lengths, seq_len):
    """Rows as lists of input indices, one document at a time (the textbook loop)."""
    rows, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, free in enumerate(room) if free >= lengths[i]), len(rows))
        if r == len(rows):
            rows.append([])
            room.append(seq_len)
        rows[r].append(i)
        room[r] -= lengths[i]
    return rows


def layout(batch):
    """Rows as lists of input indices, read from sequences whose first token is their index."""
    return [
        [
            int(batch.tokens[b, i])
            for i in np.flatnonzero(batch.positions[b] == 0)
            if batch.segment_ids[b, i]
        ]
        for b in range(batch.tokens.shape[0])
    ]


def test_first_fit_decreasing_known_example():
    # Longest first: 6 -> row 0, 5 -> row 1, 5 -> row 1, 4 -> row 0: two full rows.
    seqs = [[i] * n for i, n in enumerate([6, 5, 4, 5])]
    batch, _ = check(seqs, 10)
    assert layout(batch) == [[0, 2], [1, 3]] and batch.fill_ratio == 1.0
    # In input order the 5 after the 6 opens a row, and so does the last 5: three rows.
    batch, _ = check(seqs, 10, order="in_order")
    assert layout(batch) == [[0], [1, 2], [3]]


@pytest.mark.parametrize("seed", range(3))
def test_first_fit_decreasing_matches_the_loop(seed):
    rng = np.random.default_rng(seed)
    seq_len = int(rng.integers(8, 40))
    lengths = rng.integers(1, seq_len + 1, 150).tolist()
    seqs = [[i] * n for i, n in enumerate(lengths)]  # the first token names the sequence
    batch = pack_sequences(seqs, seq_len)
    assert layout(batch) == naive_first_fit_decreasing(lengths, seq_len)


def test_equal_lengths_keep_input_order():
    batch = pack_sequences([[i] * 3 for i in range(5)], 7)
    assert layout(batch) == [[0, 1], [2, 3], [4]]


def test_deterministic_and_input_kinds():
    rng = np.random.default_rng(7)
    seqs, masks = random_input(rng, 40, 30)
    a = pack_sequences(seqs, 32, loss_masks=masks)
    b = pack_sequences([s.tolist() for s in seqs], 32, loss_masks=[m.astype(bool) for m in masks])
    c = pack_sequences(iter([tuple(s) for s in seqs]), 32, loss_masks=masks)
    for other in (b, c):
        for name, x in a.model_inputs().items():
            np.testing.assert_array_equal(x, other.model_inputs()[name])
    rows = pack_sequences(np.arange(12, dtype=np.uint16).reshape(3, 4), 8)  # a 2-D array
    assert rows.tokens.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 0, 0, 0, 0]]


def test_num_rows_and_row_multiple():
    seqs = [[1] * 6, [2] * 6, [3] * 6]  # three rows of 8
    assert pack_sequences(seqs, 8).tokens.shape == (3, 8)
    assert pack_sequences(seqs, 8, row_multiple=4).tokens.shape == (4, 8)
    assert pack_sequences(seqs, 8, row_multiple=3).tokens.shape == (3, 8)
    batch, _ = check(seqs, 8, num_rows=6, row_multiple=2)
    assert batch.tokens.shape == (6, 8) and batch.fill_ratio == 18 / 48
    assert not batch.segment_ids[3:].any()
    with pytest.raises(ValueError, match=PREFIX + r"the sequences need 3 rows .* got num_rows=2"):
        pack_sequences(seqs, 8, num_rows=2)
    with pytest.raises(ValueError, match=PREFIX + r"num_rows must be a multiple of row_multiple=4"):
        pack_sequences(seqs, 8, num_rows=6, row_multiple=4)


def test_truncate():
    seqs, masks = [[1, 2, 3, 4, 5, 6], [7, 8]], [[0, 1, 1, 0, 1, 1], [1, 1]]
    with pytest.raises(
        ValueError, match=PREFIX + r"sequences\[0\] has 6 tokens, more than seq_len=4"
    ):
        pack_sequences(seqs, 4)
    _, docs = check(seqs, 4, masks, truncate=True)
    assert sorted(d[1:] for d in docs) == [((1, 2, 3, 4), (2, 3, -100, -100)), ((7, 8), (8, -100))]


def test_empty_inputs():
    for seqs in ([], [[], np.zeros(0, np.float32)]):
        batch, _ = check(seqs, 5)
        assert batch.tokens.shape == (0, 5) and batch.fill_ratio == 0.0 and batch.num_sequences == 0
    batch, _ = check([], 5, num_rows=2, pad_id=3)
    assert batch.tokens.tolist() == [[3] * 5] * 2 and batch.fill_ratio == 0.0
    batch, _ = check([[], [4, 5], []], 5, [[], [1, 1], []])
    assert batch.num_sequences == 1 and batch.tokens.shape == (1, 5)


def test_exactly_seq_len_and_single_token_rows():
    batch, _ = check([list(range(10, 18))], 8)
    assert batch.tokens.shape == (1, 8) and batch.fill_ratio == 1.0
    assert batch.targets.tolist() == [[*range(11, 18), IGNORE_INDEX]]
    batch, _ = check([[1, 2], [3]], 1, truncate=True)
    assert batch.tokens.tolist() == [[1], [3]] and (batch.targets == IGNORE_INDEX).all()


def test_pad_id_and_batch_api():
    batch, _ = check([[1, 2, 3]], 5, pad_id=9)
    assert batch.tokens.tolist() == [[1, 2, 3, 9, 9]]
    inputs = batch.model_inputs()
    assert list(inputs) == ["tokens", "targets", "segment_ids", "positions"]
    assert inputs["targets"] is batch.targets
    assert repr(batch) == "PackedBatch(rows=1, seq_len=5, num_sequences=1, fill_ratio=0.6000)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.fill_ratio = 1.0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(seq_len=0), ValueError, r"seq_len must be an int in \[1, \d+\], got 0"),
        (dict(seq_len="8"), TypeError, r"seq_len must be an int >= 1, got str '8'"),
        (dict(seq_len=True), TypeError, r"seq_len must be an int >= 1, got bool"),
        (dict(row_multiple=0), ValueError, r"row_multiple must be an int in \[1, "),
        (dict(pad_id=-1), ValueError, r"pad_id must be an int in \[0, "),
        (dict(num_rows=-1), ValueError, r"num_rows must be an int in \[0, "),
        (dict(num_rows=2.0), TypeError, r"num_rows must be an int >= 0, got float"),
        (dict(truncate="yes"), TypeError, r"truncate must be a bool, got str"),
        (dict(order="best_fit"), ValueError, r"order must be one of .*, got 'best_fit'"),
        (dict(sequences=5), TypeError, r"sequences must be a sequence of 1-D .* got int"),
        (dict(sequences="abc"), TypeError, r"sequences must be a sequence of 1-D .* got str"),
        (dict(sequences=[1, 2]), ValueError, r"sequences\[0\] must be a 1-D .* got shape \(\) "),
        (
            dict(sequences=[[1], [[1, 2]]]),
            ValueError,
            r"sequences\[1\] must be a 1-D .* got shape \(1, 2\)",
        ),
        (
            dict(sequences=[[1.0, 2.0]]),
            TypeError,
            r"sequences\[0\] must hold integer .* got dtype float64",
        ),
        (
            dict(sequences=[[True]]),
            TypeError,
            r"sequences\[0\] must hold integer .* got dtype bool",
        ),
        (
            dict(sequences=[[1], [2, -3]]),
            ValueError,
            r"sequences\[1\] has token id -3 at index 1; .* in \[0, ",
        ),
        (
            dict(sequences=[[2**31]]),
            ValueError,
            r"sequences\[0\] has token id 2147483648 at index 0",
        ),
        (
            dict(sequences=[np.array([2**63], np.uint64)]),
            ValueError,
            r"sequences\[0\] has token id 9223372036854775808, more than int32",
        ),
        (
            dict(sequences=[[1, 2] * 5]),
            ValueError,
            r"sequences\[0\] has 10 tokens, more than seq_len=8 \(pass trunc",
        ),
        (dict(loss_masks=7), TypeError, r"loss_masks must be None or one 0/1 .* got int"),
        (
            dict(loss_masks=[[1, 1]]),
            ValueError,
            r"loss_masks must have one mask per sequence \(2\), got 1",
        ),
        (
            dict(loss_masks=[[1, 1], [1]]),
            ValueError,
            r"loss_masks\[1\] must be as long as sequences\[1\] \(3\), got len",
        ),
        (
            dict(loss_masks=[[1, 1], [1, 2, 0]]),
            ValueError,
            r"loss_masks\[1\] must hold 0/1 or bools, got value 2",
        ),
        (
            dict(loss_masks=[[1, 1], [1.0, 0.0, 1.0]]),
            TypeError,
            r"loss_masks\[1\] must hold 0/1 .* got dtype float64",
        ),
        (
            dict(loss_masks=[[1, 1], 1]),
            ValueError,
            r"loss_masks\[1\] must be a 1-D sequence of 0/1 flags",
        ),
    ],
)
def test_errors(kwargs, error, match):
    args = dict(sequences=[[1, 2], [3, 4, 5]], seq_len=8) | kwargs
    with pytest.raises(error, match=PREFIX + match):
        pack_sequences(**args)


def test_docstring_examples():
    from jaxops import testing

    assert testing.run_docstring_examples(_packing) >= 10


@st.composite
def packing_inputs(draw):
    seq_len = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(0, 15), max_size=12))
    seqs = [draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)) for n in lengths]
    masks = None
    if draw(st.booleans()):
        masks = [draw(st.lists(st.booleans(), min_size=n, max_size=n)) for n in lengths]
    return seqs, seq_len, masks


@settings(max_examples=50, deadline=None)
@given(
    packing_inputs(),
    st.sampled_from(_packing.PACKING_ORDERS),
    st.integers(1, 3),
    st.integers(0, 5),
)
def test_fuzz_invariants(inputs, order, row_multiple, pad_id):
    seqs, seq_len, masks = inputs
    batch, docs = check(
        seqs, seq_len, masks, truncate=True, order=order, row_multiple=row_multiple, pad_id=pad_id
    )
    rows = batch.tokens.shape[0]
    assert rows % row_multiple == 0
    needed = len({b for b, _, _ in docs})
    assert rows == -(-needed // row_multiple) * row_multiple  # no row is left empty but rounding
    if order == "first_fit_decreasing":  # at most one row is at most half full
        fill = (batch.segment_ids != 0).sum(axis=1)[:needed]
        assert (2 * fill <= seq_len).sum() <= 1


# -------------------------------------------------------------------------------------------------
# What the decoder takes of a packed batch: segment ids >= 0, an attention mask of 0/1 only.


def _tiny_decoder():
    import jax

    from jaxops import models

    cfg = models.DecoderConfig(
        "qwen3_moe",
        vocab_size=32,
        hidden_size=16,
        num_layers=1,
        attention=models.AttentionSpec(num_heads=2, num_kv_heads=1, head_dim=8),
        moe=models.MoESpec(num_experts=2, top_k=1, expert_ffn=8),
    )
    return models.MoEDecoder(cfg, jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1]))


@pytest.mark.parametrize("device", [False, True])
@pytest.mark.parametrize(
    ("arg", "value", "match"),
    [
        (
            "segment_ids",
            -1,
            r"segment_ids must hold ids >= 0 \(0 = padding, 1, 2, \.\.\. documents\)",
        ),
        ("attention_mask", 2, r"attention_mask must hold only 0 \(padding\) and 1 \(a token\)"),
        ("attention_mask", -1, r"attention_mask must hold only 0 \(padding\) and 1 \(a token\)"),
    ],
)
def test_decoder_refuses_negative_segment_ids_and_non_binary_masks(arg, value, match, device):
    # Checked before anything is traced (params are never looked at); under jax.jit they are
    # tracers and not checked (the docstring of check_batch says so).
    import jax.numpy as jnp

    import jaxops

    model = _tiny_decoder()
    tokens = np.zeros((2, 6), np.int32)
    bad = np.ones((2, 6), np.int32)
    bad[1, 3] = value
    if device:
        bad = jnp.asarray(bad)
    for method in ("logits", "hidden_states"):
        with pytest.raises(jaxops.InvalidArgumentError) as info:
            getattr(model, method)(None, tokens, **{arg: bad})
        assert isinstance(info.value, ValueError)
        want = rf"^jaxops\.models\.MoEDecoder\.{method}: {match}, got {value} at \(1, 3\) \(1 such"
        assert re.match(want, str(info.value)), str(info.value)
    with pytest.raises(ValueError, match=rf"^jaxops\.models\.MoEDecoder\.loss: {match}"):
        model.loss(None, tokens, tokens, **{arg: bad})


def test_decoder_checks_pass_bool_masks_and_packed_batches():
    from jaxops.models import _batch

    packed = pack_sequences([[1, 2, 3], [4, 5]], seq_len=4)
    mask = np.array([[True, True, False, False]] * packed.tokens.shape[0])
    batch = _batch.check_batch(
        "op",
        32,
        1,
        "",
        packed.tokens,
        attention_mask=mask,
        segment_ids=packed.segment_ids,
        positions=packed.positions,
    )
    assert batch.segment_ids is packed.segment_ids and batch.attention_mask is mask
