"""Hostile and damaged checkpoint files: safetensors headers, HF and native indexes, casts.

The reader trusts nothing: every malformed field raises CheckpointError naming the file, the
tensor and what was expected, never another exception and never wrong data. Valid files come
from the safetensors library (the outside oracle) and from checkpoint.save; fuzzers damage them
and check the result is CheckpointError or the original tensors, bit for bit.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxops.parallel import checkpoint as ckpt

safetensors = pytest.importorskip("safetensors")
from safetensors.numpy import load_file, save_file  # noqa: E402

CheckpointError = ckpt.CheckpointError

# Distinct byte sizes (60, 14, 24, 5, 0, 4): no edit of a header can swap two tensors' data
# without also changing a size, a shape or a dtype kind, which the reader or the target refuses.
ORIGINALS = {
    "a": np.arange(15, dtype=np.float32).reshape(3, 5) * 1.5 - 7,
    "b": (np.arange(7) - 3).astype(ml_dtypes.bfloat16),
    "i": np.arange(6, dtype=np.int32).reshape(2, 3, 1) * -1000,
    "u": np.arange(5, dtype=np.uint8) * 51,
    "z": np.zeros((0, 4), np.float32),
    "s": np.full((), 123456, np.int32),
}


def _bits(a) -> bytes:
    a = np.asarray(a)
    return a.reshape(-1).view(np.uint8).tobytes() if a.size else b""


def _same(out: dict, want: dict) -> bool:
    """Same keys, dtypes, shapes and bits."""
    return sorted(out) == sorted(want) and all(
        np.asarray(out[k]).dtype == want[k].dtype
        and np.shape(out[k]) == want[k].shape
        and _bits(out[k]) == _bits(want[k])
        for k in want
    )


def _targets(arrays: dict) -> dict:
    return {k: np.zeros(v.shape, v.dtype) for k, v in arrays.items()}


def _split(raw: bytes) -> tuple[dict, bytes]:
    """A safetensors file's header (parsed) and its data bytes."""
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(header_text: bytes | str, data: bytes) -> bytes:
    text = header_text.encode() if isinstance(header_text, str) else header_text
    return len(text).to_bytes(8, "little") + text + data


def _valid_file(path: Path, arrays=None) -> Path:
    save_file(dict(ORIGINALS if arrays is None else arrays), str(path), metadata={"format": "pt"})
    return path


def _msg(*parts: str) -> str:
    """A regex matching the literal `parts` in order."""
    return ".*".join(re.escape(p) for p in parts)


# -------------------------------------------------------------------------------------------------
# Safetensors headers: every field checked as the format requires


def _set(name, field, value):
    def mutate(h):
        h[name][field] = value

    return mutate


def _delete(name, field):
    return lambda h: h[name].pop(field)


OFFSETS = "data_offsets must be [begin, end], integers with 0 <= begin <= end <= 107"
SHAPE = "shape must be a list of non-negative integers, got"

# id -> (mutation of the parsed header, the tensor named, expected message parts)
HEADER_CASES = {
    "negative_begin": (_set("a", "data_offsets", [-128, 128]), "a", (OFFSETS, "[-128, 128]")),
    "negative_both": (_set("a", "data_offsets", [-60, 0]), "a", (OFFSETS, "[-60, 0]")),
    "end_past_data": (_set("a", "data_offsets", [0, 4096]), "a", (OFFSETS, "[0, 4096]")),
    "huge": (_set("a", "data_offsets", [0, 2**70]), "a", (OFFSETS, str(2**70))),
    "swapped": (_set("a", "data_offsets", [60, 0]), "a", (OFFSETS, "[60, 0]")),
    "float_offsets": (_set("a", "data_offsets", [0.0, 60.0]), "a", (OFFSETS, "[0.0, 60.0]")),
    "bool_offsets": (_set("s", "data_offsets", [False, True]), "s", (OFFSETS, "[False, True]")),
    "three_offsets": (_set("a", "data_offsets", [0, 30, 60]), "a", (OFFSETS, "[0, 30, 60]")),
    "string_offsets": (_set("a", "data_offsets", "0,60"), "a", (OFFSETS, "'0,60'")),
    "no_offsets": (_delete("a", "data_offsets"), "a", ("no ['data_offsets']",)),
    "no_dtype": (_delete("a", "dtype"), "a", ("no ['dtype']",)),
    "no_shape": (_delete("a", "shape"), "a", ("no ['shape']",)),
    "entry_int": (lambda h: h.update(a=5), "a", ("expected an object", "got 5")),
    "entry_list": (lambda h: h.update(a=[0, 60]), "a", ("expected an object", "got [0, 60]")),
    "entry_null": (lambda h: h.update(a=None), "a", ("expected an object", "got None")),
    "dtype_unknown": (_set("a", "dtype", "F33"), "a", ("dtype must be a safetensors", "'F33'")),
    "dtype_lowercase": (_set("a", "dtype", "f32"), "a", ("dtype must be a safetensors", "'f32'")),
    "dtype_int": (_set("a", "dtype", 7), "a", ("dtype must be a safetensors", "got 7")),
    "shape_negative": (_set("a", "shape", [-3, -5]), "a", (SHAPE, "[-3, -5]")),
    "shape_string": (_set("a", "shape", "35"), "a", (SHAPE, "'35'")),
    "shape_string_64": (_set("i", "shape", "64"), "i", (SHAPE, "'64'")),
    "shape_bool": (_set("u", "shape", [True, 5]), "u", (SHAPE, "[True, 5]")),
    "shape_float": (_set("a", "shape", [3.0, 5]), "a", (SHAPE, "[3.0, 5]")),
    "shape_nested": (_set("a", "shape", [[3], 5]), "a", (SHAPE, "[[3], 5]")),
    "shape_huge": (_set("a", "shape", [2**70, 2**70]), "a", ("is too large", "2**60")),
    "shape_huge_empty": (_set("a", "shape", [0, 2**70]), "a", ("is too large", "2**60")),
    "bytes_mismatch": (_set("a", "shape", [3, 4]), "a", ("F32[3, 4] takes 48 bytes", "hold 60")),
    "overlap": (_set("u", "data_offsets", [55, 60]), "u", ("overlaps tensor", "share bytes")),
    "gap": (
        lambda h: h["u"].update(shape=[4], data_offsets=[103, 107]),
        "u",
        ("the data bytes [102, 103) before it", "expected tensors stored back to back"),
    ),
    "metadata_int": (
        lambda h: h["__metadata__"].update(format=1),
        "__metadata__",
        ("must be an object of strings to strings", "{'format': 1}"),
    ),
    "metadata_list": (
        lambda h: h.update(__metadata__=["pt"]),
        "__metadata__",
        ("must be an object of strings to strings", "['pt']"),
    ),
}


@pytest.mark.parametrize("case", list(HEADER_CASES.values()), ids=list(HEADER_CASES))
def test_hostile_header_entries(tmp_path, case):
    mutate, tensor, parts = case
    header, data = _split(_valid_file(tmp_path / "ok.safetensors").read_bytes())
    assert len(data) == 107
    mutate(header)
    path = tmp_path / "model.safetensors"
    path.write_bytes(_join(json.dumps(header), data))
    with pytest.raises(CheckpointError, match=_msg(str(path), tensor, *parts)):
        ckpt.import_safetensors(path, _targets(ORIGINALS))
    with pytest.raises(Exception):  # noqa: B017 - the oracle refuses these files too
        load_file(path)


def _file_case(tmp_path: Path, case: str) -> tuple[Path, tuple[str, ...]]:
    """A damaged file (not one bad entry) and the message parts expected for it."""
    raw = _valid_file(tmp_path / "ok.safetensors").read_bytes()
    header, data = _split(raw)
    text = json.dumps(header)
    path = tmp_path / "model.safetensors"
    content, parts = {
        "trailing_bytes": (
            _join(text, data + b"\0" * 8),
            ("8 data bytes after the last tensor", "expected none"),
        ),
        "truncated_data": (raw[:-1], ("'u'", OFFSETS.replace("107", "106"), "[102, 107]")),
        "truncated_header": (raw[:40], ("header should have", "the file has 32")),
        "short_file": (raw[:5], ("shorter than 8 bytes",)),
        "huge_header_length": ((1 << 40).to_bytes(8, "little") + raw[8:], ("implausible",)),
        "header_not_json": (_join(text[:-1], data), ("not valid JSON",)),
        "header_not_utf8": (_join(b'{"\xff":1}', b""), ("not valid JSON", "utf-8")),
        "header_list": (_join("[]", b""), ("header is a JSON list, expected an object",)),
        "duplicate_tensor": (
            _join(text[:-1] + ', "u": ' + json.dumps(header["u"]) + "}", data),
            ("the key 'u' twice",),
        ),
        "deep_nesting": (_join("[" * 100_000 + "]" * 100_000, b""), ("not valid JSON",)),
    }[case]
    path.write_bytes(content)
    return path, parts


@pytest.mark.parametrize(
    "case",
    [
        "trailing_bytes",
        "truncated_data",
        "truncated_header",
        "short_file",
        "huge_header_length",
        "header_not_json",
        "header_not_utf8",
        "header_list",
        "duplicate_tensor",
        "deep_nesting",
    ],
)
def test_damaged_files(tmp_path, case):
    path, parts = _file_case(tmp_path, case)
    with pytest.raises(CheckpointError, match=_msg(str(path), *parts)):
        ckpt.import_safetensors(path, _targets(ORIGINALS))


def test_before_the_fix_header_bytes_came_back_as_weights(tmp_path):
    # data_offsets [-64, 64]: 64 bytes of the JSON header then 64 of data, read as a tensor.
    header = {"w": {"dtype": "U8", "shape": [128], "data_offsets": [-64, 64]}}
    path = tmp_path / "model.safetensors"
    path.write_bytes(_join(json.dumps(header), bytes(range(64))))
    with pytest.raises(CheckpointError, match=_msg(str(path), "'w'", OFFSETS[:40], "[-64, 64]")):
        ckpt.import_safetensors(path, {"w": np.zeros(128, np.uint8)})


def test_valid_edge_cases_are_accepted(tmp_path):
    """What the format allows: no metadata, null metadata, extra entry fields, padding."""
    header, data = _split(_valid_file(tmp_path / "ok.safetensors").read_bytes())
    for name, edit in {
        "no_meta": lambda h: h.pop("__metadata__"),
        "null_meta": lambda h: h.update(__metadata__=None),
        "extra_field": lambda h: h["a"].update(note=[1, {"x": None}]),
    }.items():
        h = copy.deepcopy(header)
        edit(h)
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(_join(" " + json.dumps(h) + "   ", data))
        assert _same(load_file(path), ORIGINALS)  # the oracle agrees these are valid
        assert _same(ckpt.import_safetensors(path, _targets(ORIGINALS)), ORIGINALS)


# -------------------------------------------------------------------------------------------------
# model.safetensors.index.json


def _sharded_dir(root: Path) -> Path:
    """A HF directory: two safetensors files and their index, as export_safetensors writes."""
    root.mkdir()
    first = {k: ORIGINALS[k] for k in ("a", "b", "z")}
    second = {k: ORIGINALS[k] for k in ("i", "u", "s")}
    _valid_file(root / "model-00001-of-00002.safetensors", first)
    _valid_file(root / "model-00002-of-00002.safetensors", second)
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in second})
    index = {"metadata": {"total_size": 107}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


def _wm(name, value):
    return lambda i: i["weight_map"].update({name: value})


INDEX_CASES = {
    "not_json": (lambda i: "{", ("not valid JSON",)),
    "top_level_list": (lambda i: "[]", ("expected an object with a weight_map", "a JSON list")),
    "no_weight_map": (lambda i: i.clear(), ("weight_map object", "got None")),
    "weight_map_list": (lambda i: i.update(weight_map=["a"]), ("weight_map object", "['a']")),
    "parent_dir": (_wm("a", "../x.safetensors"), ("'a'", "refusing file name '../x.safe")),
    "absolute": (_wm("a", "/etc/passwd"), ("'a'", "refusing file name '/etc/passwd'")),
    "subdir": (_wm("a", "sub/m.safetensors"), ("'a'", "refusing file name 'sub/m.safetensors'")),
    "not_safetensors": (_wm("a", "model.bin"), ("'a'", "refusing file name 'model.bin'")),
    "file_int": (_wm("a", 3), ("'a'", "refusing file name 3")),
    "missing_file": (_wm("a", "model-9.safetensors"), ("'a'", "model-9", "has no such file")),
    "wrong_file": (
        _wm("a", "model-00002-of-00002.safetensors"),
        ("puts tensor 'a' in model-00002-of-00002.safetensors", "holds no such tensor"),
    ),
    "unknown_tensor": (
        _wm("q", "model-00001-of-00002.safetensors"),
        ("puts tensor 'q' in model-00001", "holds no such tensor (it has e.g."),
    ),
    "duplicate_key": (
        lambda i: json.dumps(i)[:-2] + ', "a": "model-00001-of-00002.safetensors"}}',
        ("the key 'a' twice",),
    ),
}


@pytest.mark.parametrize("case", list(INDEX_CASES.values()), ids=list(INDEX_CASES))
def test_hostile_hf_index(tmp_path, case):
    mutate, parts = case
    root = _sharded_dir(tmp_path / "hf")
    file = root / "model.safetensors.index.json"
    index = json.loads(file.read_text())
    out = mutate(index)  # edits `index`, or returns the file's new text
    file.write_text(out if isinstance(out, str) else json.dumps(index))
    with pytest.raises(CheckpointError, match=_msg(str(file), *parts)):
        ckpt.import_safetensors(root, _targets(ORIGINALS))


def test_tensor_in_two_files_without_an_index(tmp_path):
    root = _sharded_dir(tmp_path / "hf")
    (root / "model.safetensors.index.json").unlink()
    assert _same(ckpt.import_safetensors(root, _targets(ORIGINALS)), ORIGINALS)
    _valid_file(root / "model-extra.safetensors", {"u": ORIGINALS["u"] + 1})
    with pytest.raises(CheckpointError, match=r"tensor 'u' is also in .*expected each tensor"):
        ckpt.import_safetensors(root, _targets(ORIGINALS))
    # An index says which copy is meant.
    _sharded_dir(tmp_path / "hf2")
    _valid_file(tmp_path / "hf2" / "model-extra.safetensors", {"u": ORIGINALS["u"] + 1})
    assert _same(ckpt.import_safetensors(tmp_path / "hf2", _targets(ORIGINALS)), ORIGINALS)


# -------------------------------------------------------------------------------------------------
# Dtype kinds: import_safetensors(cast=)

CAST_CASES = {
    "i32_to_f32": (np.int32, np.float32, "converting int to float"),
    "f32_to_i32": (np.float32, np.int32, "converting float to int"),
    "bf16_to_i8": (ml_dtypes.bfloat16, np.int8, "converting float to int"),
    "u8_to_i32": (np.uint8, np.int32, "converting uint to int"),
    "bool_to_f32": (np.bool_, np.float32, "converting bool to float"),
    "i8_to_bool": (np.int8, np.bool_, "converting int to bool"),
}


@pytest.mark.parametrize("case", list(CAST_CASES.values()), ids=list(CAST_CASES))
def test_kind_changes_need_cast(tmp_path, case):
    src, dst, words = case
    value = (np.arange(6) % 3).astype(src).reshape(2, 3)
    path = _valid_file(tmp_path / "model.safetensors", {"x.w": value})
    target = {"x": {"w": np.zeros((2, 3), dst)}}
    have, want = np.dtype(src).name, np.dtype(dst).name
    with pytest.raises(
        CheckpointError,
        match=_msg(f"'x/w' is {want}, but 'x.w' in {path} is {have}", words, "cast=True"),
    ):
        ckpt.import_safetensors(path, target)
    out = ckpt.import_safetensors(path, target, cast=True)["x"]["w"]
    assert out.dtype == np.dtype(dst) and _bits(out) == _bits(value.astype(dst))


@pytest.mark.parametrize(
    "src,dst",
    [
        (ml_dtypes.bfloat16, np.float32),
        (np.float32, ml_dtypes.bfloat16),
        (np.float16, np.float64),
        (np.int8, np.int32),
    ],
    ids=["bf16_to_f32", "f32_to_bf16", "f16_to_f64", "i8_to_i32"],
)
def test_precision_changes_within_a_kind_need_no_cast(tmp_path, src, dst):
    value = (np.arange(6) - 2).astype(src)
    path = _valid_file(tmp_path / "model.safetensors", {"w": value})
    out = ckpt.import_safetensors(path, {"w": np.zeros(6, dst)})["w"]
    assert _bits(out) == _bits(value.astype(dst))


def test_kind_change_of_a_stacked_rule_needs_cast(tmp_path):
    tensors = {f"l.{i}.w": np.full((2,), i, np.int32) for i in range(3)}
    path = _valid_file(tmp_path / "model.safetensors", tensors)
    rules = [ckpt.Rule("w", "l.{i}.w", stack=("i",))]
    target = {"w": jax.ShapeDtypeStruct((3, 2), np.float32)}
    with pytest.raises(CheckpointError, match=r"'w' is float32, but 'l\.0\.w' .* is int32"):
        ckpt.import_safetensors(path, target, name_map=rules)
    out = ckpt.import_safetensors(path, target, name_map=rules, cast=True)["w"]
    assert np.array_equal(out, [[0, 0], [1, 1], [2, 2]])


# -------------------------------------------------------------------------------------------------
# The native index (index.json)


def _native(root: Path) -> tuple[Path, dict]:
    """A checkpoint of sharded and host arrays: several blocks per array, two arrays alike."""
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    arrays = {
        "w": np.arange(48, dtype=np.float32).reshape(4, 12) - 9.5,
        "v": (np.arange(48, dtype=np.float32).reshape(4, 12) * 3).astype(ml_dtypes.bfloat16),
        "n": np.arange(40, dtype=np.int32).reshape(8, 5) * 7,
        "u": np.arange(7, dtype=np.uint8),
        "e": np.zeros((0, 4), np.float32),
        "s": np.full((), -5, np.int32),
    }
    tree = dict(arrays)
    tree["w"] = jax.device_put(arrays["w"], NamedSharding(mesh, P("x", "y")))
    tree["v"] = jax.device_put(arrays["v"], NamedSharding(mesh, P(None, "y")))
    tree["n"] = jax.device_put(arrays["n"], NamedSharding(mesh, P(("x", "y"))))
    ckpt.save(root, tree, step=5, metadata={"lr": 0.1})
    return root, arrays


def _block(i=0, key="w"):
    return lambda x: x["arrays"][key]["blocks"][i]


def _b(field, value, i=0, key="w"):
    return lambda x: _block(i, key)(x).update({field: value})


def _top(field, value):
    return lambda x: x.update({field: value})


def _entry(key, field, value):
    return lambda x: x["arrays"][key].update({field: value})


def _dup_block(x):  # rows 0:2 stored twice, rows 2:4 never: the element count still matches
    blocks = x["arrays"]["w"]["blocks"]
    blocks[4:] = [copy.deepcopy(b) for b in blocks[:4]]


def _share_bytes(x):  # 'u' (7 bytes) pointed at the bytes of 's' (4 bytes, stored before it)
    _block(0, "u")(x)["offset"] = _block(0, "s")(x)["offset"]


ENTRY = "malformed entry for 'w': blocks[0]"
NATIVE_CASES = {
    "version_bool": (_top("version", True), ("format version True, expected 1",)),
    "version_str": (_top("version", "1"), ("format version '1', expected 1",)),
    "checksum_md5": (_top("checksum", "md5"), ("unknown checksum 'md5'",)),
    "chunk_zero": (_top("chunk_bytes", 0), ("chunk_bytes must be an integer in [1,", "got 0")),
    "chunk_huge": (_top("chunk_bytes", 2**70), ("chunk_bytes must be", str(2**70))),
    "chunk_float": (_top("chunk_bytes", 1024.0), ("chunk_bytes must be", "got 1024.0")),
    "step_str": (_top("step", "5"), ("step must be an integer or null, got '5'",)),
    "step_bool": (_top("step", True), ("step must be an integer or null, got True",)),
    "step_missing": (lambda x: x.pop("step"), ("step must be an integer or null, got None",)),
    "nproc_zero": (_top("num_processes", 0), ("num_processes must be a positive integer",)),
    "nproc_str": (_top("num_processes", "1"), ("num_processes must be a positive", "'1'")),
    "metadata_list": (_top("metadata", []), ("metadata must be an object, got []",)),
    "created_str": (_top("created", "now"), ("created must be a number, got 'now'",)),
    "arrays_list": (_top("arrays", []), ("no 'arrays' object",)),
    "entry_str": (
        lambda x: x["arrays"].update(w="x"),
        ("malformed entry for 'w': expected an object", "got 'x'"),
    ),
    "dtype_complex": (
        _entry("w", "dtype", "complex64"),
        ("malformed entry for 'w': dtype must be one of", "got 'complex64'"),
    ),
    "shape_string": (
        _entry("w", "shape", "412"),
        ("malformed entry for 'w': shape must be a list of non-negative integers", "'412'"),
    ),
    "shape_huge": (
        _entry("w", "shape", [2**40, 2**40]),
        ("malformed entry for 'w': shape", "more than 2**60 elements"),
    ),
    "shape_huge_empty": (
        _entry("w", "shape", [0, 2**62]),
        ("malformed entry for 'w': shape", "more than 2**60 elements"),
    ),
    "blocks_object": (_entry("w", "blocks", {}), ("'w': blocks must be a list, got {}",)),
    "block_int": (lambda x: x["arrays"]["w"]["blocks"].__setitem__(0, 7), (ENTRY, "got 7")),
    "start_short": (_b("start", [0]), (ENTRY, ".start must be 2 non-negative integers", "[0]")),
    "start_bool": (_b("start", [False, 0]), (ENTRY, ".start must be 2", "[False, 0]")),
    "start_negative": (_b("start", [-2, 0]), (ENTRY, ".start must be 2", "[-2, 0]")),
    "region_outside": (_b("start", [3, 0]), (ENTRY, "start=[3, 0] shape=[2, 3] lies outside")),
    "offset_negative": (_b("offset", -8), (ENTRY, ".offset must be a non-negative", "-8")),
    "offset_float": (_b("offset", 128.0), (ENTRY, ".offset must be a non-negative", "128.0")),
    "nbytes_wrong": (_b("nbytes", 20), (ENTRY, ".nbytes must be 24 (float32[2, 3]), got 20")),
    "crc_short": (_b("crc32c", []), (ENTRY, ".crc32c must be 1 integers in [0, 2**32)", "[]")),
    "crc_long": (_b("crc32c", [1, 2]), (ENTRY, ".crc32c must be 1 integers", "[1, 2]")),
    "crc_huge": (_b("crc32c", [2**32]), (ENTRY, ".crc32c must be 1 integers", str(2**32))),
    "crc_string": (_b("crc32c", ["1"]), (ENTRY, ".crc32c must be 1 integers", "['1']")),
    "file_parent": (_b("file", "../x.safetensors"), (ENTRY, "refusing file name '../x")),
    "file_int": (_b("file", 3), (ENTRY, ".file must be a file name, got 3")),
    "file_missing": (
        _b("file", "data-00009-of-00009.safetensors"),
        ("'w' block 0", "cannot open its file data-00009-of-00009.safetensors"),
    ),
    "name_other_region": (
        _b("name", "w[2:4,0:3]"),
        (ENTRY, ".name must be 'w[0:2,0:3]' (the name of that region), got 'w[2:4,0:3]'"),
    ),
    "name_other_array": (_b("name", "v"), (ENTRY, ".name must be 'w[0:2,0:3]'", "got 'v'")),
    "offset_past_end": (
        _b("offset", 1 << 20),
        ("'w' block 0", "the index says it ends at byte", "(truncated file or corrupt index)"),
    ),
    "duplicate_block": (
        _dup_block,
        ("malformed entry for 'w': blocks[0] and blocks[4] overlap", "exactly once"),
    ),
    "missing_block": (
        lambda x: x["arrays"]["w"]["blocks"].pop(),
        ("malformed entry for 'w': the blocks hold 42 elements, the array 48",),
    ),
    "shared_bytes": (_share_bytes, ("'s' block 0 and 'u' block 0 share bytes", "stored once")),
    "key_prefix": (
        lambda x: x["arrays"].__setitem__("w/sub", copy.deepcopy(x["arrays"]["w"])),
        ("array keys 'w' and 'w/sub'", "both an array and a subtree"),
    ),
    "duplicate_key": (
        lambda x: json.dumps(x)[:-2] + ', "w": ' + json.dumps(x["arrays"]["w"]) + "}}",
        ("the key 'w' twice",),
    ),
}


@pytest.mark.parametrize("case", list(NATIVE_CASES.values()), ids=list(NATIVE_CASES))
def test_hostile_native_index(tmp_path, case):
    mutate, parts = case
    root, arrays = _native(tmp_path / "c")
    file = root / "index.json"
    index = json.loads(file.read_text())
    assert _block()(index)["shape"] == [2, 3] and len(index["arrays"]["w"]["blocks"]) == 8
    out = mutate(index)  # edits `index`, or returns the file's new text
    file.write_text(out if isinstance(out, str) else json.dumps(index))
    with pytest.raises(CheckpointError, match=_msg(str(file), *parts)):
        ckpt.restore(root, _targets(arrays))
    with pytest.raises(CheckpointError, match=_msg(str(file), *parts)):
        ckpt.restore(root)  # shapes from the index
    with pytest.raises(CheckpointError, match=_msg(str(file), *parts)):
        ckpt.describe(root)


# -------------------------------------------------------------------------------------------------
# Fuzzers: damaged copies of valid files give CheckpointError or the originals, bit for bit

HOSTILE = [2**70, -1, -(2**70), 0, 1, 7, 60, 1.5, 0.0, "64", "", "F32", None, True, False,
           [], [[1]], [0, [2]], [-1, 2], {}, {"a": 1}]  # fmt: skip


class _Dup(dict):
    """A JSON object written with one key twice (the second time with `again`)."""

    def __init__(self, items, key, again):
        super().__init__(items)
        self.key, self.again = key, again

    def __reduce_ex__(self, protocol):  # deepcopy
        return _Dup, (dict(self), self.key, self.again)


def _dumps(node) -> str:
    if isinstance(node, dict):
        pairs = list(node.items()) + ([(node.key, node.again)] if isinstance(node, _Dup) else [])
        return "{" + ",".join(json.dumps(k) + ":" + _dumps(v) for k, v in pairs) + "}"
    if isinstance(node, list):
        return "[" + ",".join(_dumps(v) for v in node) + "]"
    return json.dumps(node)


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*path, i))


def _get(node, path):
    for p in path:
        node = node[p]
    return node


def _put(root, path, value):
    _get(root, path[:-1])[path[-1]] = value


def _replace(root, path, value):
    """`root` with the node at `path` replaced by `value` (the root itself when path is ())."""
    if not path:
        return value
    _put(root, path, value)
    return root


OPS = ["replace", "delete", "duplicate", "copy", "swap", "nudge", "rename"]


def _mutate_json(doc, data, max_ops=3):
    """`doc` changed by 1..max_ops structural edits drawn from `data`; returns the JSON text."""
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, max_ops), label="ops")):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            break
        op = data.draw(st.sampled_from(OPS), label="op")
        path = data.draw(st.sampled_from(paths), label="path")
        other = data.draw(st.sampled_from(paths), label="other")
        parent, last = _get(doc, path[:-1]), path[-1]
        if op == "replace":
            parent[last] = copy.deepcopy(data.draw(st.sampled_from(HOSTILE), label="value"))
        elif op == "delete":
            del parent[last]
        elif op == "duplicate":
            if isinstance(parent, list):
                parent.append(copy.deepcopy(parent[last]))
            else:  # the key written twice: the same value again, or another
                again = data.draw(st.sampled_from([parent[last], *HOSTILE]), label="again")
                doc = _replace(doc, path[:-1], _Dup(parent, last, copy.deepcopy(again)))
        elif op == "copy":
            parent[last] = copy.deepcopy(_get(doc, other))
        elif op == "swap":
            if path[: len(other)] != other and other[: len(path)] != path:  # neither inside
                a, b = _get(doc, path), _get(doc, other)
                parent[last] = b
                _put(doc, other, a)
        elif op == "nudge":
            value = parent[last]
            if isinstance(value, int) and not isinstance(value, bool):
                step = data.draw(st.sampled_from([1, -1, 4, -4, 8, -60, 1 << 20]), label="by")
                parent[last] = value + step
        elif op == "rename" and isinstance(parent, dict):
            new = data.draw(st.sampled_from([*list(parent), "x", "__metadata__", ""]), label="to")
            if new != last:
                value = parent.pop(last)
                if new in parent:  # renamed onto an existing key: both written
                    doc = _replace(doc, path[:-1], _Dup(parent, new, value))
                else:
                    parent[new] = value
    return _dumps(doc)


def _check_import(path, originals):
    """CheckpointError, or exactly the originals."""
    try:
        out = ckpt.import_safetensors(path, _targets(originals))
    except CheckpointError:
        event("refused")
        return
    event("accepted")
    assert _same(out, originals)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A directory the fuzzers overwrite example after example."""
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def hf_file(tmp_path_factory) -> bytes:
    return _valid_file(tmp_path_factory.mktemp("hf") / "ok.safetensors").read_bytes()


@settings(max_examples=1000, deadline=None)
@given(data=st.data())
def test_fuzz_hf_header_bytes(scratch, hf_file, data):
    """Bit flips in the length and header (flips in the data are undetectable: the format has
    no checksum), or a truncation anywhere."""
    raw = bytearray(hf_file)
    header_end = 8 + int.from_bytes(raw[:8], "little")
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="length")]
    else:
        flips = st.tuples(st.integers(0, header_end - 1), st.integers(0, 7))
        for pos, bit in data.draw(st.lists(flips, min_size=1, max_size=4), label="flips"):
            raw[pos] ^= 1 << bit
    path = scratch / "flipped.safetensors"
    path.write_bytes(bytes(raw))
    _check_import(path, ORIGINALS)


@settings(max_examples=1200, deadline=None)
@given(data=st.data())
def test_fuzz_hf_header_json(scratch, hf_file, data):
    """Structural edits of the header: drop, retype, duplicate, copy, swap, rename, nudge."""
    header, payload = _split(hf_file)
    text = _mutate_json(header, data)
    pad = data.draw(st.sampled_from(["", " ", "\n" * 3]), label="pad")
    path = scratch / "edited.safetensors"
    path.write_bytes(_join(text + pad, payload))
    _check_import(path, ORIGINALS)


@pytest.fixture(scope="module")
def hf_dir(scratch) -> tuple[Path, dict]:
    root = _sharded_dir(scratch / "hf")
    return root, json.loads((root / "model.safetensors.index.json").read_text())


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_fuzz_hf_index_json(hf_dir, data):
    """Structural edits of model.safetensors.index.json (two files, six tensors)."""
    root, index = hf_dir
    (root / "model.safetensors.index.json").write_text(_mutate_json(index, data))
    _check_import(root, ORIGINALS)


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    root, arrays = _native(tmp_path_factory.mktemp("native") / "c")
    files = {p.name: p.read_bytes() for p in root.iterdir()}
    return files, arrays


def _write_native(root: Path, files: dict[str, bytes]) -> Path:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for name, content in files.items():
        (root / name).write_bytes(content)
    return root


def _check_restore(root: Path, arrays: dict, whole: bool) -> None:
    """CheckpointError, or exactly the originals (the index alone may drop whole arrays)."""
    try:
        out = ckpt.restore(root, None if whole else _targets(arrays))
    except CheckpointError:
        event("refused")
        return
    event("accepted")
    if whole:  # without a target, a smaller valid index restores fewer arrays
        assert set(out) <= set(arrays) and _same(out, {k: arrays[k] for k in out})
    else:
        assert _same(out, arrays)


@settings(max_examples=800, deadline=None)
@given(data=st.data())
def test_fuzz_native_index_json(scratch, native, data):
    """Structural edits of index.json; restore with a target and with shapes from the index."""
    files, arrays = native
    index = json.loads(files["index.json"])
    files = {**files, "index.json": _mutate_json(index, data, max_ops=2).encode()}
    root = _write_native(scratch / "native-json", files)
    _check_restore(root, arrays, whole=data.draw(st.booleans(), label="whole"))


@settings(max_examples=800, deadline=None)
@given(data=st.data())
def test_fuzz_native_bytes(scratch, native, data):
    """Bit flips anywhere in the data file (the CRCs catch those in tensor data) or in
    index.json, or a truncated data file."""
    files, arrays = native
    (data_name,) = [n for n in files if n.endswith(".safetensors")]
    name = data.draw(st.sampled_from([data_name, "index.json"]), label="file")
    raw = bytearray(files[name])
    if name == data_name and data.draw(st.booleans(), label="truncate"):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="length")]
    else:
        flips = st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 7))
        for pos, bit in data.draw(st.lists(flips, min_size=1, max_size=3), label="flips"):
            raw[pos] ^= 1 << bit
    root = _write_native(scratch / "native-bytes", {**files, name: bytes(raw)})
    _check_restore(root, arrays, whole=data.draw(st.booleans(), label="whole"))


def test_the_fuzzed_originals_are_valid(tmp_path, hf_file, native):
    """The unmutated inputs of the fuzzers restore exactly (the fuzzers test something)."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(hf_file)
    assert _same(ckpt.import_safetensors(path, _targets(ORIGINALS)), ORIGINALS)
    assert _same(load_file(path), ORIGINALS)
    assert _same(ckpt.import_safetensors(_sharded_dir(tmp_path / "hf"), _targets(ORIGINALS)),
                 ORIGINALS)  # fmt: skip
    files, arrays = native
    root = _write_native(tmp_path / "c", files)
    assert _same(ckpt.restore(root, _targets(arrays)), arrays)
    assert _same(ckpt.restore(root), arrays)
    assert len(json.loads(files["index.json"])["arrays"]["w"]["blocks"]) == 8


def _blocks(*regions):
    return [{"start": list(lo), "shape": list(n)} for lo, n in regions]


def test_tiling_check_grid_and_general_layouts():
    from jaxops.parallel.checkpoint._index import _check_tiling

    # A grid of 200 x 200 blocks (40,000) is checked by sorting its cells: a duplicate is found.
    grid = _blocks(*[((2 * i, 3 * j), (2, 3)) for i in range(200) for j in range(200)])
    _check_tiling("w", [400, 600], grid)
    dup = [*grid[:-1], dict(grid[7])]
    with pytest.raises(ckpt.CheckpointError, match=r"blocks\[7\] and blocks\[39999\] overlap"):
        _check_tiling("w", [400, 600], dup)
    # Not a grid but an exact tiling (one block spans two columns): accepted.
    _check_tiling("w", [2, 2], _blocks(((0, 0), (1, 2)), ((1, 0), (1, 1)), ((1, 1), (1, 1))))
    # Not a grid and overlapping, with the element count right: refused.
    with pytest.raises(ckpt.CheckpointError, match=r"blocks\[0\] and blocks\[1\] overlap"):
        _check_tiling("w", [2, 3], _blocks(((0, 0), (1, 2)), ((0, 1), (2, 1)), ((1, 0), (1, 1)),
                                           ((1, 2), (1, 1))))  # fmt: skip
