"""Published FP8 checkpoints in jaxops.models: block-scaled F8_E4M3 weights with float32
``weight_scale_inv`` (DeepSeek-V3, Qwen3-30B-A3B-FP8) loaded dequantized by from_pretrained and
written by save_pretrained(quantize="fp8-block").

The FP8 files are made in the test from tiny transformers models with an independent numpy
implementation of the format (hidden 160, expert ffn 200: partial 128-blocks); the reference is
the same checkpoint dequantized by numpy into float32 files. transformers reads FP8 on CPU by
dequantizing (its GPU path needs accelerate, which this environment lacks: the check is
patched out, the CPU path does not use it); its CPU dequantization takes the block size from
the scale grid (rows // scale rows), right only when the sizes are multiples of 128, so its
parity tests use such a model.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from _hf_families import COMMON, FAMILIES, max_rel_err  # noqa: E402
from jaxops.models._quant import Fp8Block, Fp8Codec  # noqa: E402
from jaxops.parallel import checkpoint  # noqa: E402

import jaxops  # noqa: E402
from jaxops import models  # noqa: E402

B = 128
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
QCONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [B, B],
}
# The decoder layers' linear weights: attention projections, expert and shared-expert
# gate/up/down. Not the embeddings, lm_head, norms, router or shared-expert gate.
QUANTIZED = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|(mlp|block_sparse_moe)\.experts\.\d+\."
    r"(gate_proj|up_proj|down_proj|w1|w2|w3)|mlp\.shared_expert\.(gate|up|down)_proj)\.weight"
)
# Sizes that are no multiples of 128: partial blocks at the ends of rows and columns.
PARTIAL = {
    "mixtral": dict(hidden_size=160, intermediate_size=200, num_local_experts=4),
    "qwen3_moe": dict(hidden_size=160, head_dim=40, moe_intermediate_size=200, num_experts=4),
    "qwen2_moe": dict(
        hidden_size=160,
        moe_intermediate_size=200,
        shared_expert_intermediate_size=136,
        num_experts=4,
    ),
}
TOL = 1e-3  # the bar for logits on FP8 files; measured ~1e-6 (same dequantized weights)


# -------------------------------------------------------------------------------------------------
# The format, from its definition: weight = float32(fp8) * scale_inv[row // 128, col // 128].


def np_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp8, scale): per 128 x 128 block scale = amax / 448, fp8 = e4m3(w / scale) (RNE)."""
    m, k = w.shape
    gm, gk = -(-m // B), -(-k // B)
    pad = np.zeros((gm * B, gk * B), np.float32)
    pad[:m, :k] = np.abs(w)
    amax = pad.reshape(gm, B, gk, B).max(axis=(1, 3))
    scale = np.maximum(amax, np.float32(1e-30)) / np.float32(448)
    full = np.repeat(np.repeat(scale, B, 0), B, 1)[:m, :k]
    return np.clip(w.astype(np.float32) / full, -448, 448).astype(E4M3), scale


def np_dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    m, k = q.shape
    return q.astype(np.float32) * np.repeat(np.repeat(scale, B, 0), B, 1)[:m, :k]


def _torch(a: np.ndarray):
    if a.dtype == E4M3:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).view(torch.float8_e4m3fn)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _numpy(t) -> np.ndarray:
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(E4M3)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def read_dir(path: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({n: _numpy(t) for n, t in safetensors_torch.load_file(f).items()})
    return out


def write_dir(path: Path, tensors: dict[str, np.ndarray], config: dict) -> Path:
    """Weights in one file, scales in another (an index says which is where), config.json."""
    path.mkdir(parents=True)
    files = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for name, a in tensors.items():
        files[f"model-0000{1 + name.endswith('_scale_inv')}-of-00002.safetensors"][name] = a
    weight_map = {}
    for fname, part in files.items():
        safetensors_torch.save_file(
            {n: _torch(a) for n, a in part.items()}, path / fname, metadata={"format": "pt"}
        )
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(config))
    return path


def fp8_checkpoint(src: Path, out: Path, quantized: re.Pattern = QUANTIZED) -> tuple[Path, Path]:
    """`src` (float32 files) as an FP8 checkpoint, and that checkpoint dequantized (float32).

    The tensors whose names match `quantized` are stored as FP8.
    """
    tensors = read_dir(src)
    config = json.loads((src / "config.json").read_text())
    fp8, deq = {}, {}
    for name, w in tensors.items():
        fp8[name] = deq[name] = w
        if quantized.fullmatch(name):
            fp8[name], fp8[name + "_scale_inv"] = np_quantize(w)
            deq[name] = np_dequantize(fp8[name], fp8[name + "_scale_inv"])
    assert sum(a.dtype == E4M3 for a in fp8.values()) >= 10
    return (
        write_dir(out / "fp8", fp8, {**config, "quantization_config": QCONFIG}),
        write_dir(out / "deq", deq, config),
    )


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """family -> (fp8 dir, its float32 dequantization); plus "aligned": a Qwen3-MoE whose sizes
    are multiples of 128 (transformers' CPU dequantization), as ("aligned", "aligned_deq")."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for family, sizes in PARTIAL.items():
        cfg_cls, model_cls, extra = FAMILIES[family]
        config = getattr(transformers, cfg_cls)(**{**COMMON, **extra, **sizes})
        _save(getattr(transformers, model_cls)(config), root / family / "f32")
        out[family] = fp8_checkpoint(root / family / "f32", root / family)
    config = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
    )
    _save(transformers.Qwen3MoeForCausalLM(config), root / "aligned" / "f32")
    out["aligned"] = fp8_checkpoint(root / "aligned" / "f32", root / "aligned")
    return out


def _save(model, path: Path) -> None:
    torch.manual_seed(0)
    with torch.no_grad():  # norms and biases away from their init so that a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(path)


def _mesh(shape=(1,), names=("expert",)):
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def _tokens(batch: int = 8, seq: int = 12) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 128, (batch, seq)).astype(np.int32)


def _logits(model, params, tokens):
    return np.asarray(jax.jit(model.logits)(params, model.place_batch(tokens)))


def _hf_logits(path: Path, tokens: np.ndarray, monkeypatch) -> np.ndarray:
    """transformers' logits from `path` (FP8 files: its CPU path, which dequantizes)."""
    quantizer = pytest.importorskip("transformers.quantizers.quantizer_finegrained_fp8")
    monkeypatch.setattr(quantizer, "is_accelerate_available", lambda: True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _assert_same(a, b) -> None:
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
    ):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), path


# -------------------------------------------------------------------------------------------------
# Loading FP8 files.


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp8_files_load_dequantized_bit_for_bit(dirs, family):
    fp8, deq = dirs[family]
    for dtype in ("float32", "bfloat16"):
        _, got = models.from_pretrained(fp8, dtype=dtype)
        _, want = models.from_pretrained(deq, dtype=dtype)
        _assert_same(got, want)  # the numpy dequantization, cast once to the dtype
    # The config's dtype is the default, as for unquantized files.
    assert models.from_pretrained(fp8)[1]["layers"]["w_qkv"].dtype == jnp.float32


@pytest.mark.parametrize("family,mesh", [("qwen3_moe", "d2e4"), ("qwen2_moe", "1dev")])
def test_fp8_logits_match_the_dequantized_model(dirs, family, mesh, monkeypatch):
    fp8, deq = dirs[family]
    shape = {"d2e4": ((2, 4), ("data", "expert")), "1dev": ((1,), ("expert",))}[mesh]
    model, params = models.from_pretrained(fp8, mesh=_mesh(*shape))
    tokens = _tokens()
    got = _logits(model, params, tokens)
    want = _hf_logits(deq, tokens, monkeypatch)  # transformers on the float32 dequantization
    err = max_rel_err(got, want)
    print(f"{family} on {mesh}: FP8 files vs transformers on their dequantization: {err:.1e}")
    assert err <= TOL, err


def test_transformers_reads_the_same_fp8_files(dirs, monkeypatch):
    fp8, _ = dirs["aligned"]
    model, params = models.from_pretrained(fp8, mesh=_mesh((2, 4), ("data", "expert")))
    tokens = _tokens()
    err = max_rel_err(_logits(model, params, tokens), _hf_logits(fp8, tokens, monkeypatch))
    print(f"FP8 files, ours vs transformers': {err:.1e}")
    assert err <= TOL, err


# -------------------------------------------------------------------------------------------------
# Writing them: save_pretrained(quantize="fp8-block").


def test_save_fp8_block_round_trip(dirs, tmp_path):
    _, deq = dirs["qwen2_moe"]  # shared expert and its gate; partial blocks
    model, params = models.from_pretrained(deq, mesh=_mesh((2, 4), ("data", "expert")))
    out = tmp_path / "saved"
    names = models.save_pretrained(
        model, params, out, dtype="bfloat16", quantize="fp8-block", max_shard_size="300KB"
    )
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        **QCONFIG,
        "modules_to_not_convert": ["lm_head", "mlp.gate", "mlp.shared_expert_gate"],
    }
    assert config["dtype"] == "bfloat16"
    stored = read_dir(out)
    source = read_dir(deq)
    assert set(stored) == set(names)
    quantized = {n for n in source if QUANTIZED.fullmatch(n)}
    assert set(stored) == set(source) | {n + "_scale_inv" for n in quantized}
    for name, w in source.items():
        if name in quantized:
            # jaxops' quantization of the float32 parameters, bit for bit the format's numpy one
            q, s = np_quantize(w)
            assert stored[name].dtype == E4M3 and stored[name + "_scale_inv"].dtype == np.float32
            assert stored[name + "_scale_inv"].shape == (-(-w.shape[0] // B), -(-w.shape[1] // B))
            assert np.array_equal(stored[name].view(np.uint8), q.view(np.uint8)), name
            assert np.array_equal(stored[name + "_scale_inv"], s), name
        else:  # embeddings, norms, router, shared-expert gate, lm_head: the save dtype
            assert stored[name].dtype == ml_dtypes.bfloat16, name
            assert np.array_equal(stored[name], w.astype(ml_dtypes.bfloat16)), name
    # Read back: exactly dequant(quant(w)), i.e. what numpy makes of the written files.
    reference = {
        n: np_dequantize(a, stored[n + "_scale_inv"]) if a.dtype == E4M3 else a
        for n, a in stored.items()
        if not n.endswith("_scale_inv")
    }
    ref = write_dir(tmp_path / "reference", reference, {**config, "quantization_config": None})
    _, again = models.from_pretrained(out, dtype="float32")
    _, want = models.from_pretrained(ref, dtype="float32")
    _assert_same(again, want)


def test_transformers_reads_save_pretrained_fp8(dirs, tmp_path, monkeypatch):
    model, params = models.from_pretrained(dirs["aligned"][0].parent / "f32")  # unquantized
    models.save_pretrained(model, params, tmp_path / "fp8", quantize=jaxops.fp8.BLOCK)
    _, again = models.from_pretrained(tmp_path / "fp8")
    tokens = _tokens()
    ours = _logits(model, again, tokens)
    err = max_rel_err(ours, _hf_logits(tmp_path / "fp8", tokens, monkeypatch))
    assert err <= TOL, err
    assert 1e-4 < max_rel_err(ours, _logits(model, params, tokens)) < 0.1  # quantized, and close


# -------------------------------------------------------------------------------------------------
# Refusals.


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _drop_tensor(path: Path, name: str, replace=None) -> None:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    fname = index["weight_map"][name]
    tensors = safetensors_torch.load_file(path / fname)
    if replace is None:
        del tensors[name], index["weight_map"][name]
    else:
        tensors[name] = replace
    safetensors_torch.save_file(tensors, path / fname, metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_or_misshaped_scales_name_the_tensor_and_file(dirs, tmp_path):
    fp8, _ = dirs["mixtral"]
    weight = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    path = _copy(fp8, tmp_path / "missing")
    _drop_tensor(path, weight + "_scale_inv")
    match = rf"'{re.escape(weight)}' in .*model-00001-of-00002.safetensors is F8_E4M3\[200, 160\]"
    with pytest.raises(checkpoint.CheckpointError, match=match + ".* is missing; .* F32\\[2, 2\\]"):
        models.from_pretrained(path)
    path = _copy(fp8, tmp_path / "shape")
    _drop_tensor(path, weight + "_scale_inv", torch.ones(2, 1))
    with pytest.raises(checkpoint.CheckpointError, match=match + r".* is F32\[2, 1\]"):
        models.from_pretrained(path)
    # The import itself (the codec) checks too: the names, their file, the key.
    config = models.read_config(path)
    model = models.MoEDecoder(config, _mesh())
    codec = Fp8Codec(Fp8Block())
    with pytest.raises(
        checkpoint.CheckpointError,
        match=rf"'layers/moe/w_in' from \[.*\] in .*00001-of-00002.safetensors: "
        rf"'{re.escape(weight)}_scale_inv': the scale has shape \[2, 1\]; .* needs \[2, 2\]",
    ):
        checkpoint.import_safetensors(
            path, model.abstract_params(), name_map=models.name_map(config), codec=codec
        )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -0.5])
def test_nan_inf_zero_or_negative_scales_are_refused_by_name(dirs, tmp_path, bad):
    # A published-format file whose weight_scale_inv holds a value no quantizer writes would
    # load as NaN (or sign-flipped) weights and NaN logits: refused, naming the tensor and file.
    fp8, _ = dirs["mixtral"]
    weight = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    path = _copy(fp8, tmp_path / "bad")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    scale = safetensors_torch.load_file(path / index["weight_map"][weight + "_scale_inv"])
    scale = scale[weight + "_scale_inv"].clone()
    scale[1, 0] = bad
    _drop_tensor(path, weight + "_scale_inv", scale)
    with pytest.raises(
        checkpoint.CheckpointError,
        match=rf"^jaxops\.models\.from_pretrained: 'layers/moe/w_in' from \[.*\] in "
        rf".*00001-of-00002.safetensors: '{re.escape(weight)}_scale_inv': the scale must be "
        rf"finite and > 0 in every block, got {re.escape(str(np.float32(bad)))} at \[1, 0\] "
        r"\(1 block\(s\)\); refusing",
    ):
        models.from_pretrained(path)


@pytest.mark.parametrize(
    "quant,match",
    [
        ({"quant_method": "gptq", "bits": 4}, r"quant_method 'gptq' is not supported"),
        ({"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes' is not supported"),
        ({**QCONFIG, "fmt": "e5m2"}, r"fmt 'e5m2' is not supported"),
        ({**QCONFIG, "scale_fmt": "ue8m0"}, r"scale_fmt 'ue8m0' is not supported"),
        ({**QCONFIG, "activation_scheme": "static"}, r"activation_scheme 'static'"),
        ({"quant_method": "fp8"}, r"weight_block_size must be two positive ints"),
    ],
)
def test_other_quantizations_are_refused_by_name(dirs, tmp_path, quant, match):
    path = _copy(dirs["qwen3_moe"][0], tmp_path / "q")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(models.ConfigError, match=match):
        models.from_pretrained(path)


def test_scales_without_quantization_config_and_bad_quantize_are_refused(dirs, tmp_path):
    path = _copy(dirs["qwen3_moe"][0], tmp_path / "q")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(checkpoint.CheckpointError, match=r"weight_scale_inv.*quantization_config"):
        models.from_pretrained(path)
    model, params = models.from_pretrained(dirs["qwen3_moe"][1])
    with pytest.raises(jaxops.InvalidArgumentError, match=r"quantize must be None, a jaxops\.fp8"):
        models.save_pretrained(model, params, tmp_path / "out", quantize="fp8")
    with pytest.raises(jaxops.InvalidArgumentError, match=r"quantize=Recipe\('tensor'\) is not"):
        models.save_pretrained(model, params, tmp_path / "out", quantize=jaxops.fp8.TENSOR)
