"""MXFP4 checkpoints (gpt-oss's published experts): OCP Microscaling FP4 loaded dequantized.

gpt-oss stores each expert weight ``X`` (``model.layers.{i}.mlp.experts.gate_up_proj`` /
``down_proj``; transformers' module layout ``[E, in, out]``) as uint8 ``X_blocks [E, out, in/32,
16]`` (FP4 E2M1, two per byte, low nibble first) and uint8 ``X_scales [E, out, in/32]`` (E8M0).

The reference here is written from the format's definition (bit fields of E2M1, ``2 ** (s -
127)`` of E8M0), element by element in Python floats; transformers' own dequantization (the
function its loader calls, and its loader end to end with ``Mxfp4Config(dequantize=True)``) is
a second, outside oracle. Every comparison of weights is bit for bit: every FP4 value times a
power of two is exact in float32 and in bfloat16.

Then import_safetensors into a stacked, expert-sharded target (8 CPU devices), bad files (the
errors name the tensor and its file), from_pretrained's MXFP4 checks with a model type whose
files are never MXFP4, and from_pretrained of a tiny gpt-oss MXFP4 checkpoint end to end
(logits against transformers' dequantized model; skipped while model_type gpt_oss is not read).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxops.models._quant import (
    Fp8Block,
    Fp8Codec,
    Mxfp4,
    Mxfp4Codec,
    dequantize_mxfp4,
    mxfp4_check,
    read_quantization,
)
from jaxops.parallel import checkpoint
from jaxops.parallel.checkpoint import CheckpointError, Rule
from safetensors.numpy import save_file

from jaxops._errors import ConfigError

BF16 = np.dtype(ml_dtypes.bfloat16)
EXPERTS = "model.layers.{i}.mlp.experts."
# Small, non-square gpt-oss-like sizes: hidden H = 96, intermediate F = 64 (gate_up [E, 96, 128]
# in the module layout, stored [E, 128, 3, 16]; down [E, 64, 96], stored [E, 96, 2, 16]).
L, E, H, F = 2, 8, 96, 64


# -------------------------------------------------------------------------------------------------
# The format, from its definition.


def e2m1(code: int) -> float:
    """FP4 E2M1: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; exponent 0 subnormal."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent = (code >> 1) & 0b11
    mantissa = code & 0b1
    if exponent == 0:
        return sign * mantissa * 0.5  # 0.m * 2 ** (1 - bias)
    return sign * (1.0 + mantissa / 2) * 2.0 ** (exponent - 1)


def e8m0(code: int) -> float:
    """E8M0: 2 ** (code - 127); code 255 is NaN."""
    assert 0 <= code <= 254
    return 2.0 ** (code - 127)


def reference(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[E, in, out]`` (the module layout) of ``[E, out, in/32, 16]`` blocks, one element
    at a time: exact products in Python floats, rounded once to float32 (+-inf beyond its range)."""
    e_, out_, groups, width = blocks.shape
    assert width == 16 and scales.shape == blocks.shape[:-1]
    values = np.empty((e_, out_, groups * 32), np.float32)
    with np.errstate(over="ignore"):
        for e, o, g, j in np.ndindex(*blocks.shape):
            byte, scale = int(blocks[e, o, g, j]), e8m0(int(scales[e, o, g]))
            values[e, o, 32 * g + 2 * j] = e2m1(byte & 0xF) * scale  # the low nibble first
            values[e, o, 32 * g + 2 * j + 1] = e2m1(byte >> 4) * scale
    return values.transpose(0, 2, 1)


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view({4: np.uint32, 2: np.uint16}[a.dtype.itemsize])


def every_code(shape: tuple[int, int, int, int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Blocks holding every byte (every ordered pair of nibbles) and scales every code 0..254."""
    rng = np.random.default_rng(seed)
    blocks = rng.permutation(np.arange(np.prod(shape)) % 256).astype(np.uint8).reshape(shape)
    scales = rng.permutation(np.arange(np.prod(shape[:-1])) % 255).astype(np.uint8)
    scales = scales.reshape(shape[:-1])
    assert set(np.unique(blocks)) == set(range(256)) and set(np.unique(scales)) == set(range(255))
    return blocks, scales


def random_mxfp4(rng, out: int, inner: int) -> tuple[np.ndarray, np.ndarray]:
    """Random ``[E, out, inner/32, 16]`` blocks and scales near 2**0 (weights of order one)."""
    blocks = rng.integers(0, 256, (E, out, inner // 32, 16), dtype=np.uint8)
    scales = rng.integers(120, 131, (E, out, inner // 32), dtype=np.uint8)
    return blocks, scales


# -------------------------------------------------------------------------------------------------
# (a) The codec against the definition.


def test_e2m1_table_is_the_format():
    assert [e2m1(c) for c in range(16)] == [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0
    ]  # fmt: skip
    assert np.signbit(e2m1(8))  # code 8 is -0


def test_decode_is_bit_exact_over_every_code():
    blocks, scales = every_code((2, 40, 4, 16))
    want = reference(blocks, scales)
    stored = {"x_blocks": blocks, "x_scales": scales}
    got = Mxfp4Codec().decode("x", stored.__getitem__)
    assert got.dtype == np.float32 and got.shape == (2, 4 * 32, 40)
    assert np.array_equal(bits(got), bits(want))
    # The format's values themselves (no transpose) and the target dtype's cast: also exact.
    assert np.array_equal(bits(dequantize_mxfp4(blocks, scales)), bits(want.transpose(0, 2, 1)))
    assert np.array_equal(bits(got.astype(BF16)), bits(want.astype(BF16)))
    assert np.array_equal(bits(want.astype(BF16).astype(np.float32)), bits(want))  # bf16-exact


def test_decode_extremes():
    # One block per scale code of interest; its 16 bytes 0x00, 0x11, ..., 0xFF: every code twice.
    codes = [0, 1, 126, 127, 128, 252, 253, 254]
    blocks = np.tile((np.arange(16) * 0x11).astype(np.uint8), (1, len(codes), 1, 1))
    scales = np.array(codes, np.uint8).reshape(1, len(codes), 1)
    got = Mxfp4Codec().decode("x", {"x_blocks": blocks, "x_scales": scales}.__getitem__)
    got = got[0, 0::2, :].T  # [code, nibble]
    assert np.array_equal(bits(got), bits(reference(blocks, scales)[0, 0::2, :].T))
    tiny = got[codes.index(0)]
    assert bits(tiny)[1] == 0x0020_0000 and tiny[1] == 2.0**-128  # 0.5 * 2**-127: subnormal
    assert tiny[7] == 6 * 2.0**-127 and np.signbit(tiny[8]) and tiny[8] == 0  # -0 kept
    big = got[codes.index(254)]
    assert big[3] == 1.5 * 2.0**127 and np.isfinite(big[:4]).all()  # up to 1.5 * 2**127 fits
    assert (big[4:8] == np.inf).all() and (big[12:] == -np.inf).all()  # 2 * 2**127: overflow
    assert got[codes.index(253)][5] == 3 * 2.0**126 and got[codes.index(253)][6] == np.inf


def test_decode_reads_plain_tensors_as_they_are():
    plain = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    stored = {"x": plain}
    codec = Mxfp4Codec()
    assert codec.stored("x", stored) == ("x",)
    assert codec.decode("x", lambda n: stored[n] if n in stored else _missing(n)) is plain
    assert codec.encode("x", plain) is None  # written as it is
    assert codec.stored("x", {"x_scales": 0}) == ("x_blocks", "x_scales")  # blocks then missing


def _missing(name):
    raise ValueError(f"the files hold no tensor {name!r}")


@pytest.mark.parametrize(
    "blocks,scales,match",
    [
        ((1, 4, 2, 16), (1, 4, 3), r"scales have shape \[1, 4, 3\]; blocks \[1, 4, 2, 16\]"),
        ((1, 4, 2, 8), (1, 4, 2), r"blocks must have shape \[\.\.\., out, in / 32, 16\]"),
        ((4, 2, 16), (4, 2), r"'x_blocks' has shape \[4, 2, 16\]; MXFP4 expert weights"),
    ],
    ids=["scales-shape", "block-width", "not-experts"],
)
def test_decode_refuses_shapes_that_do_not_fit(blocks, scales, match):
    stored = {"x_blocks": np.zeros(blocks, np.uint8), "x_scales": np.zeros(scales, np.uint8)}
    with pytest.raises(ValueError, match=match):
        Mxfp4Codec().decode("x", stored.__getitem__)


def test_decode_refuses_nan_scales_and_other_dtypes():
    blocks, scales = np.zeros((2, 3, 1, 16), np.uint8), np.full((2, 3, 1), 127, np.uint8)
    scales[1, 2, 0] = scales[0, 1, 0] = 255
    with pytest.raises(ValueError, match=r"'x'.*code 255 \(NaN in E8M0\) at \[0, 1, 0\] \(2 "):
        Mxfp4Codec().decode("x", {"x_blocks": blocks, "x_scales": scales}.__getitem__)
    stored = {"x_blocks": blocks.view(np.int8), "x_scales": np.ones((2, 3, 1), np.uint8)}
    with pytest.raises(ValueError, match=r"must be uint8, got int8 and uint8"):
        Mxfp4Codec().decode("x", stored.__getitem__)
    with pytest.raises(ValueError, match=r"'x_blocks' is stored but its scales are missing"):
        Mxfp4Codec().decode("x", lambda n: blocks if n == "x_blocks" else _missing(n))


def test_read_quantization():
    published = {  # openai/gpt-oss-20b's config.json
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    quant = read_quantization({"quantization_config": published})
    assert quant == Mxfp4(tuple(published["modules_to_not_convert"]))
    assert read_quantization({"quantization_config": {"quant_method": "mxfp4"}}) == Mxfp4()
    for bad, match in [
        ({"bits": 4}, r"unsupported key\(s\) \['bits'\]"),
        ({"modules_to_not_convert": "lm_head"}, r"modules_to_not_convert must be a list"),
        ({"dequantize": "yes"}, r"dequantize must be a bool"),
    ]:
        with pytest.raises(ConfigError, match=match):
            read_quantization({"quantization_config": {"quant_method": "mxfp4", **bad}})
    with pytest.raises(ConfigError, match=r"'gptq' is not supported; supported: 'fp8'.*'mxfp4'"):
        read_quantization({"quantization_config": {"quant_method": "gptq"}})


# -------------------------------------------------------------------------------------------------
# (b) transformers' dequantization, an outside oracle.


def test_transformers_dequantization_agrees_bit_for_bit():
    torch = pytest.importorskip("torch")
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = every_code((2, 40, 4, 16), seed=1)
    ours = Mxfp4Codec().decode("x", {"x_blocks": blocks, "x_scales": scales}.__getitem__)
    tb, ts = torch.from_numpy(blocks), torch.from_numpy(scales)
    theirs = mxfp4.convert_moe_packed_tensors(tb, ts, dtype=torch.float32).numpy()
    assert theirs.shape == ours.shape and np.array_equal(bits(theirs), bits(ours))
    theirs16 = mxfp4.convert_moe_packed_tensors(tb, ts, dtype=torch.bfloat16)
    assert np.array_equal(
        theirs16.view(torch.int16).numpy().view(np.uint16), bits(ours.astype(BF16))
    )


def test_transformers_loader_gives_the_module_layout(tmp_path):
    # transformers' GptOss loader (Mxfp4Config(dequantize=True)): the parameters it builds from
    # MXFP4 files are what the codec gives for the same name (gate_up_proj [E, hidden, 2 * ffn],
    # down_proj [E, ffn, hidden]).
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    st = pytest.importorskip("safetensors.torch")
    cfg = transformers.GptOssConfig(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=F,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention"],
    )
    transformers.GptOssForCausalLM(cfg).save_pretrained(tmp_path / "bf16")
    tensors = st.load_file(tmp_path / "bf16" / "model.safetensors")
    rng = np.random.default_rng(2)
    stored = {}
    for name, (out, inner) in {"gate_up_proj": (2 * F, H), "down_proj": (H, F)}.items():
        x = EXPERTS.format(i=0) + name
        assert tuple(tensors.pop(x).shape) == (4, inner, out)  # the bf16 checkpoint's layout
        stored[x + "_blocks"] = rng.integers(0, 256, (4, out, inner // 32, 16), dtype=np.uint8)
        stored[x + "_scales"] = rng.integers(118, 133, (4, out, inner // 32), dtype=np.uint8)
    (tmp_path / "q").mkdir()
    st.save_file(
        {**tensors, **{k: torch.from_numpy(v) for k, v in stored.items()}},
        tmp_path / "q" / "model.safetensors",
        metadata={"format": "pt"},
    )
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    model = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path / "q",
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
    )
    experts = model.model.layers[0].mlp.experts
    for name in ("gate_up_proj", "down_proj"):
        theirs = getattr(experts, name).detach().numpy()
        ours = Mxfp4Codec().decode(EXPERTS.format(i=0) + name, stored.__getitem__)
        assert theirs.shape == ours.shape and np.array_equal(bits(theirs), bits(ours))


# -------------------------------------------------------------------------------------------------
# (c) import_safetensors: a stacked, expert-sharded target.


RULES = [
    Rule("layers/moe/w_in", EXPERTS + "gate_up_proj", stack=("i",)),
    Rule("layers/moe/w_out", EXPERTS + "down_proj", stack=("i",)),
    Rule("layers/moe/b_in", EXPERTS + "gate_up_proj_bias", stack=("i",)),
    Rule("layers/moe/b_out", EXPERTS + "down_proj_bias", stack=("i",)),
]
SHAPES = {
    "w_in": (L, E, H, 2 * F),
    "w_out": (L, E, F, H),
    "b_in": (L, E, 2 * F),
    "b_out": (L, E, H),
}


def write_checkpoint(path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A two-file gpt-oss-like MoE checkpoint with an index (layer 1's scales in layer 0's file).

    Returns the reference, our stacked arrays in float32.
    """
    rng = np.random.default_rng(seed)
    files: list[dict[str, np.ndarray]] = [{}, {}]
    want = {k: np.empty(s, np.float32) for k, s in SHAPES.items()}
    for i in range(L):
        x = EXPERTS.format(i=i)
        for key, name, (out, inner) in [("w_in", "gate_up_proj", (2 * F, H)),
                                        ("w_out", "down_proj", (H, F))]:  # fmt: skip
            blocks, scales = random_mxfp4(rng, out, inner)
            blocks[0, 0, 0, 0], scales[0, 0, 0] = 0x97, 0  # 6 and -0.5 times 2**-127
            files[i][x + name + "_blocks"] = blocks
            files[0][x + name + "_scales"] = scales
            want[key][i] = reference(blocks, scales)
        for key, name, n in [("b_in", "gate_up_proj_bias", 2 * F), ("b_out", "down_proj_bias", H)]:
            bias = rng.standard_normal((E, n)).astype(BF16)
            files[i][x + name] = bias
            want[key][i] = bias.astype(np.float32)
    path.mkdir()
    weight_map = {}
    for k, tensors in enumerate(files):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file(tensors, path / fname)
        weight_map.update(dict.fromkeys(tensors, fname))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return want


def target(dtype, mesh=None) -> dict:
    """Our tree: expert-sharded on `mesh`, or (None) numpy arrays."""
    if mesh is None:
        moe = {k: np.zeros(s, dtype) for k, s in SHAPES.items()}
    else:
        sharding = NamedSharding(mesh, P(None, "expert"))
        moe = {k: jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for k, s in SHAPES.items()}
    return {"layers": {"moe": moe}}


class CountingCodec(Mxfp4Codec):
    def __init__(self):
        super().__init__()
        self.decoded: list[str] = []

    def decode(self, name, read):
        self.decoded.append(name)
        return super().decode(name, read)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
def test_import_into_expert_sharded_stack_is_bit_exact(tmp_path, dtype):
    want = write_checkpoint(tmp_path / "ckpt")
    mesh = jax.make_mesh((8,), ("expert",), devices=jax.devices()[:8])
    codec = CountingCodec()
    out = checkpoint.import_safetensors(tmp_path / "ckpt", target(dtype, mesh), name_map=RULES,
                                        codec=codec)  # fmt: skip
    for key, ref in want.items():
        got = out["layers"]["moe"][key]
        assert got.dtype == dtype and got.shape == ref.shape
        assert got.sharding == NamedSharding(mesh, P(None, "expert"))
        assert len({s.device for s in got.addressable_shards}) == 8
        for shard in got.addressable_shards:  # each device holds its experts
            assert shard.data.shape == (L, E // 8, *ref.shape[2:])
        assert np.array_equal(bits(np.asarray(got)), bits(ref.astype(dtype)))
    # Each layer's tensor is decoded once, though eight devices hold parts of it.
    assert sorted(codec.decoded) == sorted(
        EXPERTS.format(i=i) + n for i in range(L) for n in
        ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
    )  # fmt: skip
    tiny = np.asarray(out["layers"]["moe"]["w_in"])[0, 0, 1, 0]  # the high nibble of byte 0
    assert tiny == -(2.0**-128) and np.signbit(tiny)  # a subnormal, in bfloat16 too


def test_import_unsharded_and_plain_tensors(tmp_path):
    want = write_checkpoint(tmp_path / "ckpt", seed=3)
    out = checkpoint.import_safetensors(tmp_path / "ckpt", target(np.float32), name_map=RULES,
                                        codec=Mxfp4Codec())  # fmt: skip
    for key, ref in want.items():
        assert isinstance(out["layers"]["moe"][key], np.ndarray)
        assert np.array_equal(bits(out["layers"]["moe"][key]), bits(ref))
    # Written back without a codec that quantizes: plain tensors under the module-layout names
    # (what save_pretrained of an MXFP4-loaded model writes), read back alike by the same codec.
    names = checkpoint.export_safetensors(out, tmp_path / "plain", name_map=RULES,
                                          codec=Mxfp4Codec(), dtype="bfloat16")  # fmt: skip
    assert not any(n.endswith(("_blocks", "_scales")) for n in names)
    written = checkpoint.hf_tensors(tmp_path / "plain")[EXPERTS.format(i=1) + "gate_up_proj"]
    assert (written.dtype, written.shape) == ("BF16", (E, H, 2 * F))  # the module layout
    back = checkpoint.import_safetensors(tmp_path / "plain", target(np.float32), name_map=RULES,
                                         codec=Mxfp4Codec())  # fmt: skip
    for key, ref in want.items():
        assert np.array_equal(
            bits(back["layers"]["moe"][key]), bits(ref.astype(BF16).astype(np.float32))
        )


def test_import_checks_kinds_against_the_decoded_float(tmp_path):
    write_checkpoint(tmp_path / "ckpt")
    moe = {"w_in": jax.ShapeDtypeStruct(SHAPES["w_in"], np.int32)}
    with pytest.raises(
        CheckpointError, match=r"'layers/moe/w_in' is int32.*is float32: converting"
    ):
        checkpoint.import_safetensors(tmp_path / "ckpt", {"layers": {"moe": moe}}, name_map=RULES,
                                      codec=Mxfp4Codec())  # fmt: skip
    # Without the codec the rules' names are missing: the error says which.
    with pytest.raises(CheckpointError, match=r"needs \['model\.layers\.0\.mlp\.experts\.gate_up_"):
        checkpoint.import_safetensors(tmp_path / "ckpt", target(np.float32), name_map=RULES)


# -------------------------------------------------------------------------------------------------
# (d) Bad files: the error names the tensor and its file.


def _one_file(tmp_path: Path, **edits) -> tuple[Path, dict]:
    """Layer 0 only, one file; `edits` replace (None: drop) tensors by their short names."""
    rng = np.random.default_rng(4)
    x = EXPERTS.format(i=0)
    tensors = {}
    for name, (out, inner) in {"gate_up_proj": (2 * F, H), "down_proj": (H, F)}.items():
        tensors[x + name + "_blocks"], tensors[x + name + "_scales"] = random_mxfp4(rng, out, inner)
    for short, value in edits.items():
        if value is None:
            del tensors[x + short]
        else:
            tensors[x + short] = value(tensors[x + short]) if callable(value) else value
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    moe = {k: jax.ShapeDtypeStruct((1, *SHAPES[k][1:]), np.float32) for k in ("w_in", "w_out")}
    return path, {"layers": {"moe": moe}}


def _nan_scale(scales):
    scales = scales.copy()
    scales[5, 7, 1] = 255
    return scales


@pytest.mark.parametrize(
    "edits,match",
    [
        (
            dict(gate_up_proj_scales=np.zeros((E, 2 * F, 2), np.uint8)),
            r"'layers/moe/w_in' from \['model\.layers\.0\.mlp\.experts\.gate_up_proj'\] in "
            r"\S*model\.safetensors: 'model\.layers\.0\.mlp\.experts\.gate_up_proj' \(.*\): MXFP4 "
            r"scales have shape \[8, 128, 2\]; blocks \[8, 128, 3, 16\] need one per block",
        ),
        (
            dict(down_proj_scales=_nan_scale),
            r"'layers/moe/w_out' from \['model\.layers\.0\.mlp\.experts\.down_proj'\] in "
            r"\S*model\.safetensors: .*code 255 \(NaN in E8M0\) at \[5, 7, 1\]",
        ),
        (
            dict(down_proj_scales=None),
            r"'layers/moe/w_out' needs \['model\.layers\.0\.mlp\.experts\.down_proj_scales'\] "
            r"\(1 missing\) in \S*model\.safetensors",
        ),
        (
            dict(gate_up_proj_blocks=None),
            r"needs \['model\.layers\.0\.mlp\.experts\.gate_up_proj_blocks'\]",
        ),
        (
            dict(gate_up_proj_blocks=lambda b: b.reshape(E, 2 * F, 6, 8)),
            r"gate_up_proj' \(.*\): MXFP4 blocks must have shape",
        ),
    ],
    ids=["scales-shape", "nan-scale", "no-scales", "no-blocks", "block-width"],
)
def test_bad_files_name_the_tensor_and_file(tmp_path, edits, match):
    path, tree = _one_file(tmp_path, **edits)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.import_safetensors(path, tree, name_map=RULES, codec=Mxfp4Codec())


@pytest.mark.parametrize(
    "edits,match",
    [
        (dict(down_proj_scales=None), r"'.*down_proj' is stored as MXFP4 \(\S*model\.safetensors"
         r"\), but '.*down_proj_scales' is missing"),
        (dict(gate_up_proj_scales=np.zeros((E, 2 * F, 2), np.uint8)),
         r"'.*gate_up_proj_scales' in \S*model\.safetensors is U8\[8, 128, 2\]; its blocks "
         r"\[8, 128, 3, 16\] \(in \S*model\.safetensors\) need U8\[8, 128, 3\]"),
        (dict(gate_up_proj_blocks=lambda b: b.view(np.int8)),
         r"'.*gate_up_proj_blocks' in \S*model\.safetensors is I8\[8, 128, 3, 16\]; expected U8"),
    ],
    ids=["no-scales", "scales-shape", "blocks-dtype"],
)  # fmt: skip
def test_header_checks_name_the_tensor_and_file(tmp_path, edits, match):
    path, _ = _one_file(tmp_path, **edits)
    names = {EXPERTS.format(i=0) + n for n in ("gate_up_proj", "down_proj")}
    with pytest.raises(CheckpointError, match=match):
        mxfp4_check("op", checkpoint.hf_tensors(path), names)


def test_header_check_gives_the_stored_names(tmp_path):
    path, _ = _one_file(tmp_path)
    tensors = checkpoint.hf_tensors(path)
    names = {EXPERTS.format(i=0) + n for n in ("gate_up_proj", "down_proj", "gate_up_proj_bias")}
    assert mxfp4_check("op", tensors, names) == set(tensors)


def test_fp8_codec_unchanged_by_stored_names(tmp_path):
    # A codec without `stored` (Fp8Codec): every tensor is stored under its own name.
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    codec = Fp8Codec(Fp8Block(), quantize={"w.weight"})
    names = checkpoint.export_safetensors({"w": {"weight": w}}, tmp_path / "f", codec=codec)
    assert sorted(names) == ["w.weight", "w.weight_scale_inv"]
    back = checkpoint.import_safetensors(tmp_path / "f", {"w": {"weight": w}}, codec=codec)
    np.testing.assert_allclose(back["w"]["weight"], w, rtol=0.07)


# -------------------------------------------------------------------------------------------------
# from_pretrained's MXFP4 wiring, with a model type it reads today (the per-expert tensors of
# such files are never MXFP4: the checks and the plain path).


def test_from_pretrained_reads_mxfp4_configs(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from _hf_families import hf_model

    from jaxops import models

    path = tmp_path / "m"
    hf_model("qwen3_moe").save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": None}
    (path / "config.json").write_text(json.dumps(config))
    ref_model, ref = models.from_pretrained(path, dtype=np.float32)  # tensors stored as they are
    saved = tmp_path / "saved"
    models.save_pretrained(ref_model, ref, saved)
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    # Blocks and scales of a name the config implies must fit the format (checked from headers).
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    x = "model.layers.0.mlp.experts.0.gate_proj.weight"
    save_file(
        {
            x + "_blocks": np.zeros((32, 2, 16), np.uint8),
            x + "_scales": np.zeros((32, 2), np.uint8),
        },
        bad / "model-mx.safetensors",
    )
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight_blocks' in \S*model-mx\.safe"
                       r"tensors is U8\[32, 2, 16\]; expected U8\[experts, out"):  # fmt: skip
        models.from_pretrained(bad)
    # Stray MXFP4 tensors of names it does not imply are extra, as any other tensor.
    (bad / "model-mx.safetensors").unlink()
    save_file({"model.layers.0.mlp.experts.gate_up_proj_scales": np.zeros((8, 2), np.uint8)},
              bad / "model-mx.safetensors")  # fmt: skip
    with pytest.raises(CheckpointError, match=r"does not account for.*gate_up_proj_scales.*"
                       r"quantization_config = mxfp4"):  # fmt: skip
        models.from_pretrained(bad)


# -------------------------------------------------------------------------------------------------
# from_pretrained of a gpt-oss MXFP4 checkpoint, end to end (once model_type gpt_oss is read).


def _gpt_oss_mxfp4(tmp_path: Path, seed: int = 0):
    """(transformers' dequantized model, the MXFP4 directory, the stored blocks and scales): a
    tiny random gpt-oss whose experts are stored as random MXFP4, as the published ones are."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    st = pytest.importorskip("safetensors.torch")
    from _hf_families import randomize

    cfg = transformers.GptOssConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=4,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    randomize(transformers.GptOssForCausalLM(cfg), 4.0).save_pretrained(tmp_path / "plain")
    tensors = st.load_file(tmp_path / "plain" / "model.safetensors")
    rng = np.random.default_rng(seed)
    stored = {}
    for i in range(2):
        for name, (out, inner) in {"gate_up_proj": (64, 64), "down_proj": (64, 32)}.items():
            x = EXPERTS.format(i=i) + name
            assert tuple(tensors.pop(x).shape) == (8, inner, out)
            stored[x + "_blocks"] = rng.integers(0, 256, (8, out, inner // 32, 16), dtype=np.uint8)
            stored[x + "_scales"] = rng.integers(122, 127, (8, out, inner // 32), dtype=np.uint8)
    path = tmp_path / "mxfp4"
    path.mkdir()
    st.save_file(
        {**tensors, **{k: torch.from_numpy(v) for k, v in stored.items()}},
        path / "model.safetensors",
        metadata={"format": "pt"},
    )
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (path / "config.json").write_text(json.dumps(config))
    torch_model = transformers.GptOssForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    return torch_model, path, stored


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
def test_from_pretrained_gpt_oss_mxfp4(tmp_path, dtype):
    torch_model, path, stored = _gpt_oss_mxfp4(tmp_path)
    from _hf_families import check_logits, mesh, random_tokens

    from jaxops import models

    model, params = models.from_pretrained(path, mesh=mesh("d2e4"), dtype=dtype)
    codec = Mxfp4Codec()
    for ours, theirs in (("w_in", "gate_up_proj"), ("w_out", "down_proj")):
        want = np.stack([codec.decode(EXPERTS.format(i=i) + theirs, stored.__getitem__)
                         for i in range(2)])  # fmt: skip
        got = params["layers"]["moe"][ours]
        assert got.dtype == dtype and np.array_equal(
            bits(np.asarray(got)), bits(want.astype(dtype))
        )
    if dtype == np.float32:
        check_logits(model, params, torch_model, random_tokens(16), "gpt_oss mxfp4")
        # Written back unquantized: the module-layout tensors, no quantization_config.
        names = models.save_pretrained(model, params, tmp_path / "saved")
        assert EXPERTS.format(i=1) + "gate_up_proj" in names
        assert not any(n.endswith(("_blocks", "_scales")) for n in names)
        saved = json.loads((tmp_path / "saved" / "config.json").read_text())
        assert "quantization_config" not in saved
        _, back = models.from_pretrained(tmp_path / "saved", mesh=mesh("1dev"))
        assert np.array_equal(np.asarray(back["layers"]["moe"]["w_in"]),
                              np.asarray(params["layers"]["moe"]["w_in"]))  # fmt: skip
