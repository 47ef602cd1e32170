"""Multi-token prediction (jaxops.models._mtp): DeepSeek-V3's and GLM-4.5's MTP modules, as shipped.

Each family's checkpoint is made by transformers with one layer more than its config says: that
last layer (``model.layers.{L}``, transformers' own decoder layer with its MoE block) is the MTP
module's layer, and the module's own tensors (``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``, the copies of the embedding and head) are written beside it with the
safetensors library, every one random. The oracle runs the module in float64 from transformers'
modules: the trunk (the model cut to L layers), transformers' RMSNorm class for the norms, the
MTP layer itself, the head.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hf_families import build, max_rel_err, mesh, random_tokens, randomized_adapters
from jaxops.models import post
from jaxops.models._adapters import lora_targets
from jaxops.parallel.checkpoint import CheckpointError, hf_tensors
from safetensors.numpy import load_file, save_file

import jaxops
from jaxops import models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = ("deepseek_v3", "glm4_moe")
LAYERS = 3  # the tiny configs' num_hidden_layers (layer 0 dense, 1 and 2 MoE)
SEQ = 12


def _module_tensors(layer: int, hidden: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The MTP module's own tensors at `layer`, random (the norms off 1)."""
    pre = f"model.layers.{layer}."
    norm = lambda: (1.0 + 0.2 * rng.standard_normal(hidden)).astype(np.float32)  # noqa: E731
    return {
        pre + "enorm.weight": norm(),
        pre + "hnorm.weight": norm(),
        pre + "shared_head.norm.weight": norm(),
        pre + "eh_proj.weight": (0.1 * rng.standard_normal((hidden, 2 * hidden))).astype(
            np.float32
        ),
    }


def _checkpoint(root: Path, family: str, depth: int, copies: bool = True, seed: int = 0):
    """(directory, transformers model of LAYERS + depth layers in float64, the modules' tensors).

    The directory holds a checkpoint of LAYERS layers announcing `depth` MTP modules, stored at
    ``model.layers.{LAYERS + k}``: transformers' layers there, the modules' own tensors beside.
    """
    torch_model = build(family, seed=seed, num_hidden_layers=LAYERS + depth)
    with torch.no_grad():  # the padding id's row too (transformers zeroes it)
        torch_model.model.embed_tokens.weight[0].normal_(0.0, 0.02)
    path = root / f"{family}-mtp{depth}-{seed}{'' if copies else '-nocopies'}"
    torch_model.save_pretrained(path, safe_serialization=True)
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
        f.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    hidden = torch_model.config.hidden_size
    rng = np.random.default_rng(seed + 1)
    mtp = {}
    for k in range(depth):
        layer = LAYERS + k
        mtp.update(_module_tensors(layer, hidden, rng))
        if copies:
            mtp[f"model.layers.{layer}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
            mtp[f"model.layers.{layer}.shared_head.head.weight"] = tensors["lm_head.weight"]
    save_file({**tensors, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=depth)
    (path / "config.json").write_text(json.dumps(config))
    return path, _float64(torch_model), mtp


def _float64(torch_model):
    """`torch_model` in float64, its experts looped (torch's grouped GEMM has no float64)."""
    torch_model.config._experts_implementation = "eager"
    torch_model.config._attn_implementation = "eager"
    return torch_model.double()


def _oracle(torch_model, mtp: dict[str, np.ndarray], ids: np.ndarray, depth: int) -> np.ndarray:
    """float64 MTP logits ``[B, S, depth, V]`` (nan where a depth reads past the row)."""
    m = torch_model.model
    cfg = torch_model.config
    b, s = ids.shape
    t = torch.tensor(ids, dtype=torch.long)
    norm_class = type(m.norm)

    def rms(name, x):
        norm = norm_class(cfg.hidden_size, eps=cfg.rms_norm_eps).double()
        norm.weight.data = torch.tensor(mtp[name], dtype=torch.float64)
        return norm(x)

    causal = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    positions = torch.arange(s)[None].expand(b, s)
    out = np.full((b, s, depth, cfg.vocab_size), np.nan)
    with torch.no_grad():
        h = m.embed_tokens(t)
        rope = m.rotary_emb(h, positions)
        for layer in m.layers[:LAYERS]:
            h = layer(h, attention_mask=causal, position_ids=positions, position_embeddings=rope)
        x = m.norm(h)
        for k in range(1, depth + 1):
            pre = f"model.layers.{LAYERS + k - 1}."
            n = s - k  # positions 0 .. s - k - 1 read token i + k
            e = rms(pre + "enorm.weight", m.embed_tokens(t[:, k:]))
            prev = rms(pre + "hnorm.weight", x[:, :n])
            w = torch.tensor(mtp[pre + "eh_proj.weight"], dtype=torch.float64)
            y = torch.cat([e, prev], dim=-1) @ w.T
            rope_n = tuple(r[:, :n] for r in rope)
            y = m.layers[LAYERS + k - 1](
                y, attention_mask=causal[..., :n, :n], position_ids=positions[:, :n],
                position_embeddings=rope_n,
            )  # fmt: skip
            x = rms(pre + "shared_head.norm.weight", y)
            out[:, :n, k - 1] = torch_model.lm_head(x).numpy()
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """family -> (directory, float64 transformers model, the modules' tensors), depth 1."""
    root = tmp_path_factory.mktemp("mtp")
    return {f: _checkpoint(root, f, 1) for f in FAMILIES}


def _load(path, **options):
    return models.from_pretrained(path, dtype=np.float32, router_aux_loss_coef=0.0, **options)


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_logits_equal_transformers_layers(made, family):
    """The MTP module's logits equal the float64 oracle built of transformers' modules."""
    path, torch_model, mtp = made[family]
    model, params = _load(path)
    assert model.config.mtp_layers == 1
    ids = random_tokens(2, SEQ, seed=3)
    got = np.asarray(jax.jit(model.mtp_logits)(params, ids))
    want = _oracle(torch_model, mtp, ids, 1)
    assert got.shape == want.shape == (2, SEQ, 1, 128)
    err = max_rel_err(got[:, : SEQ - 1], want[:, : SEQ - 1])
    print(f"{family}: MTP logits' max relative error {err:.2e}")
    assert err < 1e-4
    # the trunk is unchanged by the modules
    trunk = np.asarray(jax.jit(model.logits)(params, ids))
    with torch.no_grad():
        cut = _float64(build(family, num_hidden_layers=LAYERS))
        cut.load_state_dict(
            {k: v for k, v in torch_model.state_dict().items() if f"layers.{LAYERS}." not in k}
        )
        ref = cut(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert max_rel_err(trunk, ref) < 1e-4


def test_two_depths_chain_post_norm_outputs(tmp_path):
    """Depth 2 reads depth 1's output after its head norm and the embedding of token i + 2."""
    path, torch_model, mtp = _checkpoint(tmp_path, "deepseek_v3", 2, seed=5)
    model, params = _load(path)
    ids = random_tokens(2, SEQ, seed=4)
    got = np.asarray(jax.jit(model.mtp_logits)(params, ids))
    want = _oracle(torch_model, mtp, ids, 2)
    for k in (1, 2):
        err = max_rel_err(got[:, : SEQ - k, k - 1], want[:, : SEQ - k, k - 1])
        assert err < 1e-4, (k, err)


@pytest.mark.parametrize("family", FAMILIES)
def test_load_save_keeps_every_mtp_tensor_bytewise(made, family, tmp_path):
    """from_pretrained -> save_pretrained writes every MTP tensor as it was read, copies too."""
    path, _, mtp = made[family]
    model, params = _load(path)
    out = tmp_path / "saved"
    written = models.save_pretrained(model, params, out)
    theirs = load_file(path / "model.safetensors")
    ours = load_file(out / "model.safetensors")
    layer = [n for n in theirs if n.startswith(f"model.layers.{LAYERS}.")]
    assert len(layer) > 20 and set(mtp) <= set(layer)
    assert set(layer) <= set(written)
    for name in layer:
        assert ours[name].dtype == theirs[name].dtype, name
        assert ours[name].tobytes() == theirs[name].tobytes(), name
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    back, params2 = _load(out)
    assert back.config == model.config
    for a, b in zip(jax.tree.leaves(params2["mtp"]), jax.tree.leaves(params["mtp"]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_fp8_export_quantizes_the_module_layer_as_the_trunks(made, tmp_path):
    """quantize=BLOCK writes the MTP layer's linears in FP8 like the trunk's, eh_proj as it is;
    base="fp8" keeps the module's layer in FP8 as stored (bytes and scales), frozen: its logits
    are those of the checkpoint dequantized at load."""
    path, _, _ = made["deepseek_v3"]
    model, params = _load(path)
    out = tmp_path / "fp8"
    models.save_pretrained(model, params, out, quantize="fp8-block")
    stored = hf_tensors(out)  # the headers
    pre = f"model.layers.{LAYERS}."
    assert stored[pre + "self_attn.kv_b_proj.weight"].dtype == "F8_E4M3"
    assert pre + "mlp.experts.0.down_proj.weight_scale_inv" in stored
    assert stored[pre + "eh_proj.weight"].dtype == "F32"
    assert pre + "eh_proj.weight_scale_inv" not in stored
    qlora, qparams = _load(out, base="fp8")
    block = qparams["mtp"]["block"]
    assert block["w_kv_b"].dtype == block["moe"]["w_out"].dtype == np.uint8
    assert block["w_kv_b_scale_inv"].dtype == np.float32
    assert qparams["mtp"]["eh_proj"].dtype == np.float32
    trunk = qparams["layers"]["w_kv_b"][0]  # the trunk's layer of the same shape, as stored
    assert trunk.shape == block["w_kv_b"][0].shape and trunk.dtype == np.uint8
    assert not jax.tree.leaves(qlora.trainable(qparams)["mtp"])
    deq, dparams = _load(out)  # the same checkpoint dequantized at load
    ids = random_tokens(2, SEQ, seed=6)
    want = np.asarray(jax.jit(deq.mtp_logits)(dparams, ids))[:, : SEQ - 1]
    got = np.asarray(jax.jit(qlora.mtp_logits)(qparams, ids))[:, : SEQ - 1]
    assert max_rel_err(got, want) < 1e-5


def test_a_config_announcing_absent_modules_loads_without_them(tmp_path):
    """transformers' own save (no MTP tensors, num_nextn_predict_layers kept): loads with a
    warning and mtp_layers 0; save_pretrained then writes 0."""
    torch_model = build("deepseek_v3", num_hidden_layers=LAYERS)
    torch_model.config.num_nextn_predict_layers = 1
    torch_model.save_pretrained(tmp_path / "hf")
    with pytest.warns(UserWarning, match="announces 1 multi-token-prediction module"):
        model, params = _load(tmp_path / "hf")
    assert model.config.mtp_layers == 0 and "mtp" not in params
    models.save_pretrained(model, params, tmp_path / "out")
    assert json.loads((tmp_path / "out/config.json").read_text())["num_nextn_predict_layers"] == 0


def test_unannounced_or_mismatched_modules_are_refused(made, tmp_path):
    """MTP tensors the config does not announce, and a copy of the embedding that differs from
    the model's, are refused by name."""
    path, _, _ = made["glm4_moe"]
    quiet = tmp_path / "quiet"
    quiet.mkdir()
    (quiet / "model.safetensors").symlink_to(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    (quiet / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(CheckpointError, match=f"model.layers.{LAYERS}"):
        _load(quiet)
    tensors = load_file(path / "model.safetensors")
    name = f"model.layers.{LAYERS}.embed_tokens.weight"
    tensors[name] = tensors[name] + 1.0
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"{name} differs from model.embed_tokens.weight"):
        _load(bad)


def _lora(path, **options) -> dict:
    """LoRA on every target the family of the checkpoint at `path` has, rank 4."""
    return dict(lora=jaxops.Lora(4, 8.0, lora_targets(models.read_config(path))), **options)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapts_the_modules_layers_as_peft_does(made, family, tmp_path):
    """LoRA with the MTP loss on: the modules' layers carry adapters on the trunk's targets
    (every target the family has). save_adapter writes them as ``model.layers.{L}``'s, and PEFT
    loads them onto transformers' model of L + 1 layers (its layer L is the module's): the
    float64 oracle of that model gives the MTP logits jaxops computes with the adapters (on
    transformers' L-layer model PEFT leaves them unused: the trunk's logits the same).
    merge_adapter folds them in (the merged model's MTP logits the same; its saved checkpoint's
    layer L, loaded by transformers, gives them to the oracle too) and load_adapter reads them
    back bit for bit; a model whose modules are frozen refuses them, and a trunk-only adapter
    read into the model keeps the modules' own."""
    peft = pytest.importorskip("peft")
    path, torch_model, mtp = made[family]
    model, params = _load(path, **_lora(path, mtp_loss_weight=0.3))
    params = randomized_adapters(model, params, seed=4)
    block = params["mtp"]["block"]
    assert any("_lora_" in k for k in block) and any("_lora_" in k for k in block["moe"])
    out = models.save_adapter(model, params, tmp_path / "adapter")
    stored = load_file(out / "adapter_model.safetensors")
    assert any(n.startswith(f"base_model.model.model.layers.{LAYERS}.") for n in stored)
    tuned = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(out)).eval()
    ids = random_tokens(2, SEQ, seed=5)
    got = np.asarray(jax.jit(model.mtp_logits)(params, ids))[:, : SEQ - 1]
    want = _oracle(tuned.base_model.model, mtp, ids, 1)[:, : SEQ - 1]
    err = max_rel_err(got, want)
    print(f"{family}: adapted MTP logits' max relative error against PEFT {err:.2e}")
    assert err < 1e-4
    unadapted = _oracle(torch_model, mtp, ids, 1)[:, : SEQ - 1]
    assert max_rel_err(got, unadapted) > 20 * max(err, 1e-6)  # the adapters matter
    # transformers' own L-layer model (no MTP layers): PEFT leaves the modules' adapters unused
    cut = _float64(build(family, num_hidden_layers=LAYERS))
    cut.load_state_dict(
        {k: v for k, v in torch_model.state_dict().items() if f"layers.{LAYERS}." not in k}
    )
    cut = peft.PeftModel.from_pretrained(cut, str(out)).eval()
    with torch.no_grad():
        ref = cut(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert max_rel_err(jax.jit(model.logits)(params, ids), ref) < 1e-4
    merged_model, merged = models.merge_adapter(model, params)
    np.testing.assert_allclose(
        jax.jit(merged_model.mtp_logits)(merged, ids)[:, : SEQ - 1], got, rtol=2e-5, atol=2e-5
    )
    # the merged checkpoint: transformers' layer L (the module's) holds the merged weights
    models.save_pretrained(merged_model, merged, tmp_path / "merged")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", num_hidden_layers=LAYERS + 1
    )
    want = _oracle(_float64(reloaded), mtp, ids, 1)[:, : SEQ - 1]
    assert max_rel_err(got, want) < 1e-4
    fresh = model.add_adapters(jax.tree.map(lambda x: x, params), jax.random.key(7))
    back = models.load_adapter(model, fresh, out)
    for (where, a), b in zip(
        jax.tree_util.tree_leaves_with_path(back), jax.tree.leaves(params), strict=True
    ):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(where))
    frozen, fparams = _load(path, **_lora(path))
    assert not any("_lora_" in k for k in fparams["mtp"]["block"])
    with pytest.raises(models.ConfigError, match=r"layers past the trunk's 3.*mtp_loss_weight > 0"):
        models.load_adapter(frozen, fparams, out)
    # a trunk-only adapter into the model that trains the modules: theirs kept, the trunk's read
    fparams = randomized_adapters(frozen, fparams, seed=6)
    trunk_only = models.save_adapter(frozen, fparams, tmp_path / "trunk")
    with pytest.warns(UserWarning, match="no adapters of the MTP modules' layers"):
        mixed = models.load_adapter(model, params, trunk_only)
    for key in fparams:
        want = params[key] if key == "mtp" else fparams[key]
        for (where, a), b in zip(
            jax.tree_util.tree_leaves_with_path(mixed[key]), jax.tree.leaves(want), strict=True
        ):
            np.testing.assert_array_equal(a, b, err_msg=key + jax.tree_util.keystr(where))


def test_an_mxfp4_base_leaves_the_modules_layers_unpacked():
    """base="mxfp4" packs the trunk's routed experts only (gpt-oss's published format): the
    modules' layers stay in the parameters' dtype, their adapters train with the MTP loss."""
    hf = models.family("deepseek_v3").tiny_config(num_nextn_predict_layers=1)
    cfg = models.DecoderConfig.from_hf(hf)
    lora = jaxops.Lora(4, 8.0, ("q_b_proj", "experts.down_proj"))
    model = models.MoEDecoder(cfg, mesh("1dev"), lora=lora, base="mxfp4", mtp_loss_weight=0.3)
    params = model.init(jax.random.key(0))
    assert params["layers"]["moe"]["w_in"].dtype == np.uint8
    block = params["mtp"]["block"]
    assert block["moe"]["w_in"].dtype == np.float32 and "w_in_scales" not in block["moe"]
    ids = random_tokens(2, SEQ, seed=2)
    _, grads = jax.jit(model.loss_and_grads)(params, ids, np.roll(ids, -1, axis=1))
    assert np.abs(grads["mtp"]["block"]["moe"]["w_out_lora_b"]).max() > 0  # (B fresh: 0)


def test_qlora_trains_the_modules_adapters_on_an_fp8_layer(made):
    """base="fp8" with LoRA (attention, shared and routed experts) and the MTP loss: the
    modules' layers stay FP8 bytes (bit for bit through an adamw step) while their adapters
    train; the loss is the merged (dequantized) model's. With weight 0 the modules carry no
    adapters and nothing of them is trained."""
    path, _, _ = made["deepseek_v3"]
    ids = random_tokens(2, SEQ, seed=12)
    targets = np.roll(ids, -1, axis=1)
    adapted = ("q_b_proj", "kv_b_proj", "shared_experts.down_proj", "experts.gate_up_proj")
    lora = jaxops.Lora(4, 8.0, adapted)
    model, params = _load(path, lora=lora, base="fp8", mtp_loss_weight=0.3)
    block = params["mtp"]["block"]
    assert block["w_q_b"].dtype == block["moe"]["w_in"].dtype == np.uint8
    params = randomized_adapters(model, params, seed=13)
    merged_model, merged = models.merge_adapter(model, params)
    np.testing.assert_allclose(
        jax.jit(model.loss)(params, ids, targets),
        jax.jit(merged_model.loss)(merged, ids, targets),
        rtol=2e-5,
    )
    before = jax.tree.map(np.asarray, params["mtp"])
    opt = optax.adam(1e-2)
    params, _, _ = model.train_step(opt)(params, model.init_optimizer(opt, params), ids, targets)
    for (where, a), b in zip(
        jax.tree_util.tree_leaves_with_path(params["mtp"]), jax.tree.leaves(before), strict=True
    ):
        assert (not np.array_equal(a, b)) == ("_lora_" in jax.tree_util.keystr(where)), where
    frozen, fparams = _load(path, lora=lora, base="fp8")
    assert fparams["mtp"]["block"]["w_q_b"].dtype == np.uint8
    assert not any("_lora_" in k for k in fparams["mtp"]["block"])
    assert not jax.tree.leaves(frozen.trainable(fparams)["mtp"])


def test_lora_through_a_pipeline_gives_the_one_device_loss_and_gradients(made):
    """LoRA with the MTP loss: pipe x data x expert (the modules' adapters trained after the
    last stage, among the pipeline's loss parameters; 2 microbatches) gives one device's loss
    and adapter gradients, the modules' adapters' included. (Data x expert's flat gradients of
    adapters and of the MTP modules are the other tests'.)"""
    path, _, _ = made["glm4_moe"]
    ids = random_tokens(8, 16, seed=14)
    targets = np.roll(ids, -1, axis=1)
    one, params = _load(path, **_lora(path, mtp_loss_weight=0.5))
    params = randomized_adapters(one, params, seed=15)
    want_loss, want = jax.jit(one.loss_and_grads)(params, ids, targets)
    assert any(np.abs(g).max() > 0 for g in jax.tree.leaves(want["mtp"]))
    mesh = jax.make_mesh((2, 2, 2), ("pipe", "data", "expert"), devices=jax.devices()[:8])
    options = _lora(path, mtp_loss_weight=0.5, num_microbatches=2)
    model, p = _load(path, mesh=mesh, **options)
    p = jax.tree.map(lambda a, s: jax.device_put(np.asarray(a), s), params, model.shardings())
    loss, grads = jax.jit(model.loss_and_grads)(p, *model.place_batch(ids, targets))
    np.testing.assert_allclose(loss, want_loss, rtol=2e-5)
    for (where, g), w in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(where))


def _masked_ce(logits: np.ndarray, targets: np.ndarray) -> tuple[float, int]:
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    keep = targets != -100
    picked = np.take_along_axis(np.asarray(logp), np.where(keep, targets, 0)[..., None], -1)
    return float(-(picked[..., 0] * keep).sum()), int(keep.sum())


def test_loss_adds_the_weighted_depth_loss_within_documents(made):
    """loss = main + lambda / D * CE_1, CE_1 over targets i + 1 of the same document only; the
    same over two microbatches."""
    path, _, _ = made["deepseek_v3"]
    frozen, params = _load(path)
    model, _ = _load(path, mtp_loss_weight=0.3)
    ids = random_tokens(2, SEQ, seed=7)
    targets = np.roll(ids, -1, axis=1)
    targets[:, -1] = -100
    targets[0, 2] = -100  # an ignored target stays ignored for the depth that reads it
    segments = np.array([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3], np.int32)  # packed; padding
    batch = dict(segment_ids=segments)
    main = float(jax.jit(frozen.loss)(params, ids, targets, **batch))
    got = float(jax.jit(model.loss)(params, ids, targets, **batch))
    logits = np.asarray(jax.jit(frozen.mtp_logits)(params, ids, **batch))[:, :, 0]
    want_t = np.full_like(targets, -100)
    for b in range(2):
        for i in range(SEQ - 1):
            if segments[b, i] and segments[b, i + 1] == segments[b, i]:
                want_t[b, i] = targets[b, i + 1]
    total, count = _masked_ce(logits, want_t)
    # row 0: documents of 5 and 7 (4 + 6 pairs), less the readers of the two ignored targets;
    # row 1: 9 real tokens then padding (8 pairs)
    assert count == 16
    np.testing.assert_allclose(got, main + 0.3 * total / count, rtol=2e-6)
    # one row per microbatch: each depth's count is still the whole batch's
    micro, _ = _load(path, mtp_loss_weight=0.3, num_microbatches=2)
    np.testing.assert_allclose(jax.jit(micro.loss)(params, ids, targets, **batch), got, rtol=2e-6)


def test_train_step_updates_the_modules_only_with_a_weight(made):
    """mtp_loss_weight 0: the modules are frozen (bit for bit); > 0: they train with the trunk."""
    path, _, _ = made["glm4_moe"]
    ids = random_tokens(2, SEQ, seed=8)
    targets = np.roll(ids, -1, axis=1)
    opt = optax.adam(1e-2)
    for weight in (0.0, 0.1):
        model, params = _load(path, mtp_loss_weight=weight)
        before = jax.tree.map(np.asarray, params)
        state = model.init_optimizer(opt, params)
        params, state, _ = model.train_step(opt)(params, state, ids, targets)
        pairs = zip(jax.tree.leaves(params["mtp"]), jax.tree.leaves(before["mtp"]), strict=True)
        moved = [not np.array_equal(a, b) for a, b in pairs]
        assert any(moved) == bool(weight), (weight, moved)
        assert not np.array_equal(params["final_norm"], before["final_norm"])


def test_meshes_give_the_one_device_loss_and_gradients(made):
    """The loss with the MTP term and its gradients on data x expert (flat gradients, ZeRO-1),
    context x data x expert (ring attention, ZeRO-3) and pipe x data x expert (the modules
    after the last stage, 2 microbatches, ZeRO-3; its forward-only loss too) equal one
    device's."""
    path, _, _ = made["deepseek_v3"]
    ids = random_tokens(8, 16, seed=9)
    targets = np.roll(ids, -1, axis=1)
    segments = np.array([[1] * 6 + [2] * 10, [1] * 16, [1] * 13 + [0] * 3, [1] * 16] * 2, np.int32)
    one, params = _load(path, mtp_loss_weight=0.5)
    want_loss, want = jax.jit(one.loss_and_grads)(params, ids, targets, segment_ids=segments)
    meshes = {"d2e4-zero1": ((2, 4), ("data", "expert"), {"zero": 1}),
              "c2d2e2-zero3": ((2, 2, 2), ("context", "data", "expert"), {"zero": 3}),
              "p2d2e2-zero3": ((2, 2, 2), ("pipe", "data", "expert"),
                               {"zero": 3, "num_microbatches": 2})}  # fmt: skip
    for name, (shape, axes, options) in meshes.items():
        devices = jax.devices()[: int(np.prod(shape))]
        model, p = _load(path, mesh=jax.make_mesh(shape, axes, devices=devices),
                         mtp_loss_weight=0.5, **options)  # fmt: skip
        args = model.place_batch(ids, targets, segments)
        loss, grads = jax.jit(model.loss_and_grads)(p, args[0], args[1], segment_ids=args[2])
        np.testing.assert_allclose(loss, want_loss, rtol=2e-5, err_msg=name)
        if model.pipe > 1:  # the forward-only pipeline's value
            value = jax.jit(model.loss)(p, args[0], args[1], segment_ids=args[2])
            np.testing.assert_allclose(value, want_loss, rtol=2e-5, err_msg=f"{name} loss")
        assert set(grads) == set(want), name
        for key in want:  # the modules' term reaches the layers too
            for g, w in zip(jax.tree.leaves(grads[key]), jax.tree.leaves(want[key]), strict=True):
                np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6, err_msg=f"{name} {key}")


def test_pipeline_averages_the_modules_aux_losses_over_microbatches(made):
    """With the aux losses on: a pipe of 2 stages with one data shard and 2 microbatches equals
    one device accumulating the same 2 microbatches (the modules' aux losses averaged over the
    microbatches like the stages'), loss, forward-only loss and every gradient."""
    path, _, _ = made["deepseek_v3"]
    ids = random_tokens(4, 16, seed=10)
    targets = np.roll(ids, -1, axis=1)

    def load(**options):
        options.update(router_aux_loss_coef=0.05, mtp_loss_weight=0.3, num_microbatches=2)
        return models.from_pretrained(path, dtype=np.float32, **options)

    one, params = load()
    want_loss, want = jax.jit(one.loss_and_grads)(params, ids, targets)
    model, p = load(mesh=jax.make_mesh((2, 1), ("pipe", "expert"), devices=jax.devices()[:2]))
    loss, grads = jax.jit(model.loss_and_grads)(p, ids, targets)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-5)
    np.testing.assert_allclose(jax.jit(model.loss)(p, ids, targets), want_loss, rtol=2e-5)
    for (where, g), w in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(where))


def test_bad_settings_are_refused():
    """mtp_loss_weight: a number >= 0, MTP modules in the config, no post-training step (its
    objective has no MTP term)."""
    hf = models.family("deepseek_v3").tiny_config(num_nextn_predict_layers=1)
    cfg = models.DecoderConfig.from_hf(hf)
    one = mesh("1dev")
    for bad in (-0.1, float("nan"), "0.1", True):
        with pytest.raises(models.ConfigError, match="mtp_loss_weight must be"):
            models.MoEDecoder(cfg, one, mtp_loss_weight=bad)
    plain = models.DecoderConfig.from_hf(models.family("deepseek_v3").tiny_config())
    with pytest.raises(models.ConfigError, match="mtp_layers = 0"):
        models.MoEDecoder(plain, one, mtp_loss_weight=0.1)
    with pytest.raises(models.ConfigError, match="no multi-token-prediction modules"):
        models.MoEDecoder(plain, one).mtp_logits({}, np.zeros((1, 4), np.int32))
    trained = models.MoEDecoder(cfg, one, mtp_loss_weight=0.1)  # DPO / GRPO have no MTP term
    for step in (post.dpo_step, post.grpo_step):
        with pytest.raises(models.ConfigError, match=r"post\.\w+_step: .* has no MTP term"):
            step(trained, optax.sgd(0.1))
    mixtral = models.DecoderConfig.from_hf(models.family("mixtral").tiny_config())
    with pytest.raises(models.ConfigError, match="built for glm4_moe, deepseek_v3 only"):
        dataclasses.replace(mixtral, mtp_layers=1)
    with pytest.raises(models.ConfigError, match="mtp_layers must be an int >= 0"):
        dataclasses.replace(cfg, mtp_layers=-1)
    with pytest.raises(models.ConfigError, match="num_nextn_predict_layers must be >= 0"):
        models.DecoderConfig.from_hf({**hf, "num_nextn_predict_layers": -1})
