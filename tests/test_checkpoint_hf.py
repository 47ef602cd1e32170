"""Hugging Face export and import without glue: tiny random LlamaForCausalLM models (GQA, tied and
untied embeddings) made by transformers, imported onto 8 CPU devices with hf_target +
llama_name_map in one call, exported back and loaded by transformers; tied-key checks; the q/k
RoPE permutation between the interleaved and rotate_half layouts against a numpy reference."""

from __future__ import annotations

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxops.models import llama_name_map
from jaxops.parallel import checkpoint as ckpt

pytest.importorskip("safetensors")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402

TOL = 1e-5  # max |ours - original| / max |original| for float32 logits
H, K, DH, D, F, V, LAYERS = 4, 2, 16, 64, 96, 128, 2
SPECS = {  # key templates -> PartitionSpec on a ("data", "model") mesh of 2 x 4
    "embed/embedding": P("model", "data"),
    "layers/{i}/attn/qkv/kernel": P("data", "model"),
    "layers/{i}/attn/out/kernel": P("model", None),
    "layers/{i}/mlp/gate_up/kernel": P(None, "model"),
    "layers/{i}/mlp/down/kernel": P("model", "data"),
    "layers/{i}/{norm}/scale": P(),
    "final_norm/scale": P("model"),
    "lm_head/kernel": P("data", "model"),
}


def _hf_model(tie: bool, seed: int = 0, **extra):
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        num_key_value_heads=K,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        **extra,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms and biases away from their init so that a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """tied / untied -> (model, directory written by save_pretrained, sharded with an index)."""
    out = {}
    for name, tie in (("tied", True), ("untied", False)):
        path = tmp_path_factory.mktemp("hf") / name
        model = _hf_model(tie)
        model.save_pretrained(path, max_shard_size="40KB")
        assert (path / "model.safetensors.index.json").is_file()
        out[name] = model, path
    return out


def _mesh():
    return jax.make_mesh((2, 4), ("data", "model"))


def _state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def _logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def _tokens(seed=0):
    return np.random.default_rng(seed).integers(0, V, (2, 12))


def _max_rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def _import(path, config, **kw):
    """The whole import: one call with a target built from the files' headers."""
    rules = llama_name_map(config, **kw)
    return ckpt.import_safetensors(
        path, ckpt.hf_target(path, rules, _mesh(), SPECS), name_map=rules
    )


def _rope(x, layout, base=10000.0):
    """RoPE on x [T, heads, Dh] at positions 0..T-1, in the given layout (numpy reference)."""
    dh = x.shape[-1]
    angle = np.arange(x.shape[0])[:, None] * base ** (-np.arange(0, dh, 2) / dh)  # [T, Dh/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    if layout == "rotate_half":
        a, b = x[..., : dh // 2], x[..., dh // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
    return out


def _np_llama(tree, config, tokens, rope="rotate_half"):
    """Logits of our Llama-style tree (float64 numpy): GQA, RoPE in the layout `rope`."""
    t = jax.tree.map(lambda a: np.asarray(a, np.float64), tree)
    eps = config.rms_norm_eps

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w

    x = t["embed"]["embedding"][tokens]  # [B, T, D]
    seq = x.shape[1]
    mask = np.triu(np.full((seq, seq), -np.inf), 1)
    for i in range(LAYERS):
        lay = t["layers"][str(i)]
        qkv = norm(x, lay["attn_norm"]["scale"]) @ lay["attn"]["qkv"]["kernel"]
        q, k, v = np.split(qkv, [H * DH, (H + K) * DH], axis=-1)
        heads = []
        for b in range(x.shape[0]):
            qb = _rope(q[b].reshape(seq, H, DH), rope)
            kb = np.repeat(_rope(k[b].reshape(seq, K, DH), rope), H // K, axis=1)
            vb = np.repeat(v[b].reshape(seq, K, DH), H // K, axis=1)
            s = np.einsum("thd,shd->hts", qb, kb) / np.sqrt(DH) + mask
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            heads.append(np.einsum("hts,shd->thd", p, vb).reshape(seq, H * DH))
        x = x + np.stack(heads) @ lay["attn"]["out"]["kernel"]
        gate, up = np.split(
            norm(x, lay["mlp_norm"]["scale"]) @ lay["mlp"]["gate_up"]["kernel"], 2, -1
        )
        x = x + (gate / (1 + np.exp(-gate)) * up) @ lay["mlp"]["down"]["kernel"]
    return norm(x, t["final_norm"]["scale"]) @ t["lm_head"]["kernel"]


# -------------------------------------------------------------------------------------------------
# Rules from a config


def test_llama_name_map_from_config(tmp_path):
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    rules = {r.ours: r for r in llama_name_map(cfg)}
    assert rules["layers/{i}/attn/qkv/kernel"].sizes == (64, 32, 32)
    assert rules["lm_head/kernel"].theirs == "lm_head.weight"
    assert "layers/{i}/attn/qkv/bias" not in rules
    cfg.update(head_dim=8, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for source in (cfg, transformers.LlamaConfig(**cfg), tmp_path, tmp_path / "config.json"):
        rules = {r.ours: r for r in llama_name_map(source, rope="interleaved")}
        assert rules["layers/{i}/attn/qkv/kernel"].sizes == (32, 16, 16)
        assert rules["layers/{i}/attn/qkv/bias"].rope == (8, 8, None)
        assert rules["lm_head/kernel"].theirs == "model.embed_tokens.weight"
        assert rules["layers/{i}/mlp/down/bias"].theirs == "model.layers.{i}.mlp.down_proj.bias"
    assert llama_name_map(cfg)[2].rope is None  # rotate_half: nothing to permute
    with pytest.raises(ValueError, match="num_key_value_heads that divides"):
        llama_name_map({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="rope must be"):
        llama_name_map(cfg, rope="neox")
    with pytest.raises(TypeError, match="config must be"):
        llama_name_map(42)


# -------------------------------------------------------------------------------------------------
# transformers -> us -> transformers


@pytest.mark.parametrize("tie", ["tied", "untied"])
def test_import_in_one_call_matches_the_state_dict(hf_models, tie):
    model, path = hf_models[tie]
    tree = _import(path, model.config)
    sd = _state(model)
    # Every tensor, by hand: our kernels are [in, out], q/k/v and gate/up fused.
    lay = lambda i: tree["layers"][str(i)]  # noqa: E731
    want = {
        "model.embed_tokens.weight": tree["embed"]["embedding"],
        "model.norm.weight": tree["final_norm"]["scale"],
        "lm_head.weight": np.asarray(tree["lm_head"]["kernel"]).T,
    }
    for i in range(LAYERS):
        qkv = np.asarray(lay(i)["attn"]["qkv"]["kernel"])
        gate_up = np.asarray(lay(i)["mlp"]["gate_up"]["kernel"])
        assert qkv.shape == (D, (H + 2 * K) * DH) and gate_up.shape == (D, 2 * F)
        n = f"model.layers.{i}."
        want |= {
            n + "self_attn.q_proj.weight": qkv[:, : H * DH].T,
            n + "self_attn.k_proj.weight": qkv[:, H * DH : (H + K) * DH].T,
            n + "self_attn.v_proj.weight": qkv[:, (H + K) * DH :].T,
            n + "self_attn.o_proj.weight": np.asarray(lay(i)["attn"]["out"]["kernel"]).T,
            n + "mlp.gate_proj.weight": gate_up[:, :F].T,
            n + "mlp.up_proj.weight": gate_up[:, F:].T,
            n + "mlp.down_proj.weight": np.asarray(lay(i)["mlp"]["down"]["kernel"]).T,
            n + "input_layernorm.weight": lay(i)["attn_norm"]["scale"],
            n + "post_attention_layernorm.weight": lay(i)["mlp_norm"]["scale"],
        }
    assert sorted(want) == sorted(sd)
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(value), sd[name], err_msg=name)
    if tie == "tied":  # one tensor in the files, both leaves filled from it
        files = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        assert "lm_head.weight" not in files
    # Sharded as asked, float32 as in the files.
    mesh = _mesh()
    qkv = tree["layers"]["1"]["attn"]["qkv"]["kernel"]
    assert qkv.sharding == NamedSharding(mesh, P("data", "model")) and qkv.dtype == np.float32
    assert tree["embed"]["embedding"].sharding == NamedSharding(mesh, P("model", "data"))
    assert len(qkv.addressable_shards) == 8 and qkv.addressable_shards[0].data.shape == (32, 32)
    # Our layout means what it says: a numpy forward of our tree gives transformers' logits.
    tokens = _tokens()
    assert _max_rel_err(_np_llama(tree, model.config, tokens), _logits(model, tokens)) < 1e-5


@pytest.mark.parametrize("tie", ["tied", "untied"])
def test_export_loads_in_transformers_with_the_same_logits(hf_models, tmp_path, tie):
    model, path = hf_models[tie]
    rules = llama_name_map(model.config)
    tree = _import(path, model.config)
    names = ckpt.export_safetensors(
        tree, tmp_path / "out", name_map=rules, max_shard_size="40KB", config=model.config
    )
    assert ("lm_head.weight" in names) == (tie == "untied")
    assert len(names) == len(set(names)) == 2 + LAYERS * 9 + (tie == "untied")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(names)
    written = {}
    for f in set(index["weight_map"].values()):
        written |= load_file(tmp_path / "out" / f)
    sd = _state(model)
    for name, value in written.items():
        np.testing.assert_array_equal(value, sd[name], err_msg=name)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.config.tie_word_embeddings == (tie == "tied")
    assert (back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()) == (
        tie == "tied"
    )
    tokens = _tokens(1)
    want = _logits(model, tokens)
    err = _max_rel_err(_logits(back, tokens), want)
    assert err <= TOL, err
    # The checkpoint route writes the same files.
    ckpt.save(tmp_path / "ckpt", tree)
    again = ckpt.export_safetensors(tmp_path / "ckpt", tmp_path / "again", name_map=rules)
    assert sorted(again) == sorted(names)
    again_values = load_file(tmp_path / "again" / "model.safetensors")
    assert all(np.array_equal(again_values[n], written[n]) for n in names)


def test_tied_keys_must_be_bitwise_equal(hf_models, tmp_path):
    model, path = hf_models["tied"]
    rules = llama_name_map(model.config)
    tree = jax.tree.map(np.asarray, _import(path, model.config))
    head = tree["lm_head"]["kernel"].copy()
    head[3, 5] = np.nextafter(head[3, 5], np.float32(1))  # one ulp
    bad = {**tree, "lm_head": {"kernel": head}}
    msg = (
        "'lm_head/kernel' and 'embed/embedding' both map to 'model.embed_tokens.weight' but "
        "their tensors differ"
    )
    with pytest.raises(ValueError, match=msg):
        ckpt.export_safetensors(bad, tmp_path / "bad", name_map=rules, max_shard_size="40KB")
    assert not (tmp_path / "bad").exists() and not list(tmp_path.iterdir())
    ckpt.save(tmp_path / "ckpt", bad)  # from a checkpoint, likewise
    with pytest.raises(ValueError, match=msg):
        ckpt.export_safetensors(tmp_path / "ckpt", tmp_path / "bad", name_map=rules)
    # Different dtypes or shapes: refused before anything is written.
    mixed = {**tree, "lm_head": {"kernel": tree["lm_head"]["kernel"].astype(ml_dtypes.bfloat16)}}
    with pytest.raises(ValueError, match=r"as bfloat16\[128, 64\] and float32\[128, 64\]"):
        ckpt.export_safetensors(mixed, tmp_path / "bad", name_map=rules)
    # ... unless the written tensors are equal: a cast to one dtype.
    names = ckpt.export_safetensors(mixed, tmp_path / "bf16", name_map=rules, dtype="bfloat16")
    assert names.count("model.embed_tokens.weight") == 1 and "lm_head.weight" not in names
    # Equal arrays under one name, same rule or not: written once.
    x = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    names = ckpt.export_safetensors(
        {"a": x, "b": x.copy(), "c": x.T.copy()},
        tmp_path / "eq",
        name_map=[ckpt.Rule("c", "x", transpose=(1, 0)), ckpt.Rule("{n}", "x")],
    )
    assert names == ["x"] and np.array_equal(
        load_file(tmp_path / "eq" / "model.safetensors")["x"], x
    )
    with pytest.raises(ValueError, match="'b' and 'a' both map to 'x' but their tensors differ"):
        ckpt.export_safetensors(
            {"a": x, "b": x + 1}, tmp_path / "ne", name_map=[ckpt.Rule("{n}", "x")]
        )


# -------------------------------------------------------------------------------------------------
# hf_target


def test_hf_target_specs_dtype_and_unmapped(hf_models, tmp_path):
    model, path = hf_models["untied"]
    rules = llama_name_map(model.config)
    mesh = _mesh()
    by_callable = ckpt.hf_target(
        path, rules, mesh, lambda key: P("model") if "norm" in key else None
    )
    assert by_callable["final_norm"]["scale"].sharding.spec == P("model")
    assert by_callable["lm_head"]["kernel"].sharding.spec == P()
    nested = {"embed": {"embedding": P("data")}, "final_norm": {"scale": None}, "{rest:.*}": P()}
    target = ckpt.hf_target(path, rules, mesh, nested, dtype="bfloat16")
    assert target["embed"]["embedding"].sharding.spec == P("data")
    assert target["embed"]["embedding"].dtype == ml_dtypes.bfloat16
    one = ckpt.hf_target(path, rules)  # no mesh: unsharded
    assert one["layers"]["0"]["attn"]["qkv"]["kernel"].shape == (D, (H + 2 * K) * DH)
    assert one["layers"]["0"]["attn"]["qkv"]["kernel"].sharding is None
    with pytest.raises(
        ValueError, match=r"no spec for 14 key\(s\), e.g. \['layers/0/attn_norm/scale'"
    ):
        ckpt.hf_target(path, rules, mesh, {"embed/embedding": P()})
    with pytest.raises(ValueError, match="at most 1 entries"):
        ckpt.hf_target(path, rules, mesh, P("data", "model"))
    # Tensors no rule reads: an error by default, left out, or kept under their own names.
    no_head = [r for r in rules if r.ours != "lm_head/kernel"]
    with pytest.raises(ckpt.CheckpointError, match=r"1 tensor\(s\) .* no rule reads.*lm_head"):
        ckpt.hf_target(path, no_head)
    assert "lm_head" not in ckpt.hf_target(path, no_head, unmapped="skip")
    kept = ckpt.hf_target(path, no_head, unmapped="keep")
    assert kept["lm_head"]["weight"].shape == (V, D)
    out = ckpt.import_safetensors(path, kept, name_map=no_head)
    np.testing.assert_array_equal(out["lm_head"]["weight"], _state(model)["lm_head.weight"])


def test_hf_target_inverts_stacks_and_fused_parts(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(2):
        for e in range(3):
            for n, shape in (("w1", (6, 4)), ("w3", (6, 4)), ("w2", (4, 6))):
                tensors[f"m.{i}.experts.{e}.{n}.weight"] = rng.standard_normal(shape, np.float32)
        tensors[f"m.{i}.norm.weight"] = rng.standard_normal(4).astype(ml_dtypes.bfloat16)
    save_file(tensors, tmp_path / "model.safetensors")
    rules = [
        ckpt.Rule(
            "moe/w_in",
            ["m.{i}.experts.{e}.w1.weight", "m.{i}.experts.{e}.w3.weight"],
            transpose=(1, 0),
            stack=("i", "e"),
        ),
        ckpt.Rule("moe/w_out", "m.{i}.experts.{e}.w2.weight", transpose=(1, 0), stack=("i", "e")),
        ckpt.Rule("norm/{i}", "m.{i}.norm.weight"),
    ]
    specs = {"moe/{w}": P("data", None, None, "model"), "norm/{i}": P()}
    target = ckpt.hf_target(tmp_path, rules, _mesh(), specs)
    assert target["moe"]["w_in"].shape == (2, 3, 4, 12) and target["moe"]["w_out"].shape == (
        2,
        3,
        6,
        4,
    )
    assert target["norm"]["1"].dtype == ml_dtypes.bfloat16
    out = ckpt.import_safetensors(tmp_path, target, name_map=rules)
    np.testing.assert_array_equal(
        np.asarray(out["moe"]["w_in"])[1, 2], np.concatenate([tensors["m.1.experts.2.w1.weight"],
                                                  tensors["m.1.experts.2.w3.weight"]]).T
    )  # fmt: skip
    del tensors["m.1.experts.1.w2.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ckpt.CheckpointError, match=r"'moe/w_out' stacks \('i', 'e'\).*\(1, 1\)"):
        ckpt.hf_target(tmp_path, rules)
    del tensors["m.1.experts.2.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ckpt.CheckpointError, match=r"'moe/w_in' needs \['m.1.experts.2.w3.weight"):
        ckpt.hf_target(tmp_path, rules[:1], unmapped="skip")


def _zero_stride(shape, dtype=np.float32):
    return np.lib.stride_tricks.as_strided(np.zeros((), dtype), shape, [0] * len(shape))


@pytest.mark.parametrize(
    "rule,shape",
    [
        (ckpt.Rule("w", "w.weight", transpose=(1, 0), dtype="bfloat16"), (6, 4)),
        (ckpt.Rule("qkv", ["q", "k", "v"], axis=1, sizes=(8, 4, 4), rope=(4, 4, None)), (3, 16)),
        (ckpt.Rule("moe", "m.{i}.e.{e}.w", transpose=(1, 0), stack=("i", "e")), (2, 3, 5, 7)),
    ],
    ids=["transpose-cast", "gqa-rope", "stacked"],
)
def test_export_plan_is_the_export_from_shapes_alone(rule, shape):
    arr = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    real = rule.to_theirs(rule.ours, arr)
    planned = rule.to_theirs(rule.ours, _zero_stride(shape), shapes_only=True)
    assert [(n, a.shape, a.dtype) for n, a in planned] == [(n, a.shape, a.dtype) for n, a in real]
    assert all(not any(a.strides) for _, a in planned)


def test_export_plan_allocates_nothing_of_the_tensors_size():
    # 2**40 float32 values (4 TiB) through a transpose, a GQA split with RoPE and a cast: planning
    # an export must not copy what it only needs the shapes of.
    rule = ckpt.Rule(
        "qkv",
        ["q", "k", "v"],
        transpose=(1, 0),
        sizes=(2**19, 2**18, 2**18),
        rope=(64, 64, None),
        dtype="bfloat16",
    )
    planned = rule.to_theirs("qkv", _zero_stride((2**20, 2**20)), shapes_only=True)
    assert [(n, a.shape, a.dtype) for n, a in planned] == [
        ("q", (2**19, 2**20), ml_dtypes.bfloat16),
        ("k", (2**18, 2**20), ml_dtypes.bfloat16),
        ("v", (2**18, 2**20), ml_dtypes.bfloat16),
    ]
    with pytest.raises(ValueError, match="not a multiple of the head size 48"):
        ckpt.Rule("q", ["q", "k"], rope=48).to_theirs("q", _zero_stride((64, 8)), shapes_only=True)


# -------------------------------------------------------------------------------------------------
# RoPE: interleaved <-> rotate_half


def test_rope_permutation_keeps_attention_scores():
    rng = np.random.default_rng(0)
    heads, dh, seq = 3, 8, 7
    # Random q and k vectors in the interleaved layout; the same vectors, permuted per head.
    q, k = rng.standard_normal((2, seq, heads, dh))
    rule = ckpt.Rule("qk", ["q", "k"], axis=1, rope=dh)  # on [seq, heads * dh]: ours interleaved
    parts = dict(rule.to_theirs("qk", np.concatenate([q, k], 1).reshape(seq, 2 * heads * dh)))
    q_half, k_half = (parts[n].reshape(seq, heads, dh) for n in ("q", "k"))
    scores = np.einsum("thd,shd->hts", _rope(q, "interleaved"), _rope(k, "interleaved"))
    np.testing.assert_allclose(
        np.einsum("thd,shd->hts", _rope(q_half, "rotate_half"), _rope(k_half, "rotate_half")),
        scores,
        rtol=1e-12,
        atol=1e-12,
    )
    # Not by accident: without the permutation the scores differ ...
    unpermuted = np.einsum("thd,shd->hts", _rope(q, "rotate_half"), _rope(k, "rotate_half"))
    assert np.abs(unpermuted - scores).max() > 0.1
    # ... and RoPE itself commutes with the permutation.
    order = np.r_[0:dh:2, 1:dh:2]
    np.testing.assert_allclose(_rope(q, "interleaved")[..., order], _rope(q_half, "rotate_half"))
    # Import inverts export exactly.
    assert np.array_equal(
        rule.to_ours([parts["q"], parts["k"]]), np.concatenate([q, k], 1).reshape(seq, -1)
    )


def test_rope_rule_on_torch_weights_both_directions():
    rng = np.random.default_rng(1)
    heads, kv, dh, d = 4, 2, 8, 12
    ours = rng.standard_normal((d, (heads + 2 * kv) * dh)).astype(np.float32)  # [in, out]
    names = ["q_proj.weight", "k_proj.weight", "v_proj.weight"]
    sizes = (heads * dh, kv * dh, kv * dh)
    plain = dict(ckpt.Rule("w", names, transpose=(1, 0), sizes=sizes).to_theirs("w", ours))
    # Ours interleaved, theirs transformers' rotate_half: attention scores of x agree.
    rule = ckpt.Rule("w", names, transpose=(1, 0), sizes=sizes, rope=(dh, dh, None))
    theirs = dict(rule.to_theirs("w", ours))
    np.testing.assert_array_equal(theirs["v_proj.weight"], plain["v_proj.weight"])  # v untouched
    x = rng.standard_normal((5, d))

    def scores(q_w, k_w, layout):
        q = _rope((x @ q_w.T).reshape(5, heads, dh), layout)
        k = np.repeat(_rope((x @ k_w.T).reshape(5, kv, dh), layout), heads // kv, axis=1)
        return np.einsum("thd,shd->hts", q, k)

    np.testing.assert_allclose(
        scores(theirs["q_proj.weight"], theirs["k_proj.weight"], "rotate_half"),
        scores(plain["q_proj.weight"], plain["k_proj.weight"], "interleaved"),
        rtol=1e-10,
        atol=1e-10,
    )
    assert np.array_equal(rule.to_ours([theirs[n] for n in names]), ours)
    # Ours rotate_half, theirs interleaved (Meta's originals): import applies the permutation of
    # transformers' Llama conversion, rows (h, i, 2) -> (h, 2, i) per head.
    meta = ckpt.Rule(
        "w", names, transpose=(1, 0), sizes=sizes, rope=(dh, dh, None), rope_ours="rotate_half"
    )
    q_meta = plain["q_proj.weight"]
    q_hf = q_meta.reshape(heads, dh // 2, 2, d).transpose(0, 2, 1, 3).reshape(heads * dh, d)
    imported = meta.to_ours([q_meta, plain["k_proj.weight"], plain["v_proj.weight"]])
    np.testing.assert_array_equal(imported[:, : heads * dh].T, q_hf)
    exported = dict(meta.to_theirs("w", imported))
    assert all(np.array_equal(exported[n], plain[n]) for n in names)
    # Stacked and on a bias: per element, along the rule's axis.
    stacked = ckpt.Rule("b", ["l.{i}.q.bias", "l.{i}.k.bias"], rope=dh, stack=("i",))
    biases = rng.standard_normal((2, 2 * dh))
    out = dict(stacked.to_theirs("b", biases))
    np.testing.assert_array_equal(out["l.1.k.bias"], biases[1, dh:][np.r_[0:dh:2, 1:dh:2]])
    with pytest.raises(ValueError, match="one positive even head size"):
        ckpt.Rule("w", names, rope=(dh, None))
    with pytest.raises(ValueError, match="not a multiple of the head size 8"):
        ckpt.Rule("w", "q", rope=8).to_theirs("w", ours)


@pytest.mark.parametrize("tie", ["tied", "untied"])
def test_interleaved_import_runs_meta_style_rope(hf_models, tmp_path, tie):
    """rope="interleaved": our tree runs with Meta's RoPE and gives transformers' logits."""
    model, path = hf_models[tie]
    tree = _import(path, model.config, rope="interleaved")
    tokens = _tokens(2)
    want = _logits(model, tokens)
    assert _max_rel_err(_np_llama(tree, model.config, tokens, rope="interleaved"), want) < 1e-5
    assert _max_rel_err(_np_llama(tree, model.config, tokens, rope="rotate_half"), want) > 1e-3
    rules = llama_name_map(model.config, rope="interleaved")
    ckpt.export_safetensors(tree, tmp_path / "out", name_map=rules, config=model.config)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert _max_rel_err(_logits(back, tokens), want) <= TOL


# -------------------------------------------------------------------------------------------------
# Tensors that do not fit their rule, names that cannot be templates, hostile stack indices.


def test_import_refuses_tensors_that_do_not_fit_the_rule(tmp_path):
    f = tmp_path / "model.safetensors"
    rng = np.random.default_rng(0)
    save_file(
        {
            "q": rng.standard_normal((2, 3), np.float32),
            "k": rng.standard_normal((4, 3), np.float32),
            "v": rng.standard_normal((2, 3), np.float32),
            "flat": np.arange(3, dtype=np.float32),
        },
        f,
    )
    target = {"qkv": np.zeros((8, 3), np.float32)}
    # The file's q/k/v have 2, 4, 2 rows; the rule says 4, 2, 2: refused, not cut elsewhere.
    rule = ckpt.Rule("qkv", ["q", "k", "v"], axis=0, sizes=(4, 2, 2))
    with pytest.raises(ckpt.CheckpointError, match=r"'qkv' from \['q', 'k', 'v'\] in .*model"):
        ckpt.import_safetensors(f, target, name_map=[rule])
    with pytest.raises(ckpt.CheckpointError, match=r"'w' from \['flat'\].*the transpose"):
        ckpt.import_safetensors(
            f, {"w": np.zeros(3, np.float32)}, name_map=[ckpt.Rule("w", "flat", transpose=(1, 0))]
        )
    ok = ckpt.import_safetensors(
        f, target, name_map=[ckpt.Rule("qkv", ["q", "k", "v"], axis=0, sizes=(2, 4, 2))]
    )
    assert ok["qkv"].shape == (8, 3)


def test_braces_and_metadata_names_are_refused_on_export(tmp_path):
    with pytest.raises(ValueError, match=r"key 'w\{0\}'.*placeholder"):
        ckpt.export_safetensors({"w{0}": np.ones(2, np.float32)}, tmp_path / "a")
    with pytest.raises(ValueError, match="'__metadata__'"):
        ckpt.export_safetensors({"__metadata__": np.ones(2, np.float32)}, tmp_path / "b")
    assert not list(tmp_path.iterdir())


def test_hf_target_names_missing_elements_of_a_huge_stack_at_once(tmp_path):
    # One tensor claiming expert layer 10**12: the grid is never enumerated.
    f = tmp_path / "model.safetensors"
    save_file({"model.layers.1000000000000.e.0.w": np.ones((2, 2), np.float32)}, f)
    rule = ckpt.Rule("moe/w", "model.layers.{i}.e.{e}.w", stack=("i", "e"))
    with pytest.raises(ckpt.CheckpointError, match=r"elements \[\(0, 0\), \(1, 0\), \(2, 0\)\]"):
        ckpt.hf_target(f, [rule])
