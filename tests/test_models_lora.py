"""LoRA on a published model (MoEDecoder(lora=jaxops.Lora)): the base loaded as published, the
adapters on the attention projections (GQA and MLA) and the routed experts, written in PEFT's
format and loaded by PEFT onto transformers' model of the family (the outside oracle: the same
logits within 1e-4 of the logit scale); read back unchanged; only the adapters train (the base
bit-identical after adamw steps, ZeRO 0 / 1 / 3 the same losses); fresh adapters change nothing;
refusals.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

import _hf_families as fam  # noqa: E402

import jaxops  # noqa: E402
from jaxops import (  # noqa: E402
    ConfigError,
    Lora,
    models,
)

# Every target the family has: the attention's projections (GQA's four, MLA's five), the dense
# layers' MLP, the shared experts', both expert tensors, the router, or a part of them; Llama 4's
# fused experts are read by PEFT the other way round.
CASES = {
    "qwen3_moe": ("q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj",
                  "experts.down_proj"),
    "gpt_oss": ("q_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj", "router"),
    "llama4_text": ("v_proj", "mlp.up_proj", "shared_experts.down_proj", "experts.gate_up_proj",
                    "experts.down_proj", "router"),
    "mixtral": ("k_proj", "experts.down_proj", "router"),
    "glm4_moe": ("q_proj", "experts.gate_up_proj"),
    "deepseek_v3": ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                    "mlp.gate_proj", "mlp.down_proj", "shared_experts.up_proj",
                    "experts.down_proj", "router"),
    "ernie4_5_moe": ("q_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "shared_experts.gate_proj", "shared_experts.down_proj",
                     "experts.gate_up_proj"),
    "qwen2_moe": ("q_proj", "shared_experts.gate_proj", "shared_experts.up_proj",
                  "shared_experts.down_proj", "experts.gate_up_proj"),
}  # fmt: skip


def _load(hf_families, family, targets, **options):
    torch_model, path = hf_families.hf(family)
    model, params = models.from_pretrained(
        path,
        mesh=fam.mesh("d2e4"),
        dtype=np.float32,
        lora=Lora(4, 8.0, targets),
        router_aux_loss_coef=0.0,  # the load-balancing loss is per microbatch
        **options,
    )
    return torch_model, path, model, params


@pytest.mark.parametrize("family", list(CASES))
def test_adapters_match_peft_on_transformers(hf_families, family, tmp_path):
    torch_model, _, model, params = _load(hf_families, family, CASES[family])
    params = fam.randomized_adapters(model, params)
    out = models.save_adapter(model, params, tmp_path / "adapter")
    tuned = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(out)).eval()
    tokens = fam.random_tokens(8, seed=2)
    err = fam.check_logits(model, params, tuned, tokens, f"{family} lora", tol=fam.TOL)
    # The adapters matter: transformers' model without them is another model.
    with torch.no_grad():
        base = torch_model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    assert fam.max_rel_err(
        jax.jit(model.logits)(params, model.place_batch(tokens)), base
    ) > 20 * max(err, 1e-6)
    # Read back: the same adapters, the base untouched.
    fresh = model.add_adapters({k: v for k, v in params.items()}, jax.random.key(5))
    back = models.load_adapter(model, fresh, out)
    for (path, got), want in zip(
        jax.tree_util.tree_leaves_with_path(back), jax.tree.leaves(params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path))


def test_only_the_adapters_train_and_zero_stages_agree(hf_families):
    """adamw steps on the adapters: every base weight bit-identical, every adapter moved, the
    loss down; ZeRO 1 and 3 (adapters and their optimizer state sharded) the same losses."""
    _, _, model, params = _load(hf_families, "qwen3_moe", CASES["qwen3_moe"])
    tokens = fam.random_tokens(16, seed=4)
    targets = np.roll(tokens, -1, axis=1)
    opt = optax.adamw(3e-2)
    losses = {}
    for zero in (0, 1, 3):
        m = dataclasses.replace(model, zero=zero)
        p = jax.device_put(jax.tree.map(jnp.copy, params), m.shardings())
        before = jax.tree.map(np.asarray, p)
        state = m.init_optimizer(opt, p)
        assert jax.tree.structure(state[0].mu) == jax.tree.structure(m.trainable(p))
        step = m.train_step(opt)
        batch = m.place_batch(tokens, targets)
        losses[zero] = []
        for _ in range(3):
            p, state, loss = step(p, state, *batch)
            losses[zero].append(float(loss))
        for path, old in jax.tree_util.tree_leaves_with_path(before):
            new = np.asarray(_at(p, path))
            moved = not np.array_equal(new, old)
            assert moved == ("_lora_" in jax.tree_util.keystr(path)), path
        assert losses[zero][-1] < losses[zero][0]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    np.testing.assert_allclose(losses[3], losses[0], rtol=1e-5)


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_microbatches_and_generation_with_adapters(hf_families, tmp_path):
    """Gradient accumulation over 2 microbatches gives the adapters' gradients of one batch;
    greedy generation with the adapters (the KV cache's projections adapted too), read back
    on another mesh, is PEFT's."""
    torch_model, _, model, params = _load(hf_families, "qwen3_moe", ("k_proj", "o_proj"))
    params = fam.randomized_adapters(model, params, seed=3)
    tokens = fam.random_tokens(16, seed=5)
    batch = model.place_batch(tokens, np.roll(tokens, -1, axis=1))
    loss, grads = jax.jit(model.loss_and_grads)(params, *batch)
    two = dataclasses.replace(model, num_microbatches=2)
    loss2, grads2 = jax.jit(two.loss_and_grads)(params, *batch)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-5)
    for (path, g), g2 in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads2), strict=True
    ):
        np.testing.assert_allclose(g2, g, rtol=2e-4, atol=1e-6, err_msg=str(path))
    out = models.save_adapter(model, params, tmp_path / "adapter")
    tuned = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(out)).eval()
    _, path = hf_families.hf("qwen3_moe")
    one, base = models.from_pretrained(path, mesh=fam.mesh("1dev"), lora=model.lora)
    fam.check_greedy_generate(one, models.load_adapter(one, base, out), tuned)


def test_fresh_adapters_change_nothing_and_grads_are_the_adapters_only(hf_families):
    torch_model, _, model, params = _load(hf_families, "mixtral", ("k_proj", "experts.down_proj"))
    tokens = fam.random_tokens(8, seed=1)
    fam.check_logits(model, params, torch_model, tokens, "mixtral fresh lora")
    _, grads = jax.jit(model.loss_and_grads)(params, *model.place_batch(tokens, tokens))
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(grads)}
    assert names == {
        "['layers']['k_proj_lora_a']", "['layers']['k_proj_lora_b']",
        "['layers']['moe']['w_out_lora_a']", "['layers']['moe']['w_out_lora_b']",
    }  # fmt: skip
    # B starts at zero: only B's gradient is nonzero (A's is multiplied by B).
    assert np.asarray(grads["layers"]["k_proj_lora_b"]).any()
    assert not np.asarray(grads["layers"]["k_proj_lora_a"]).any()


@pytest.mark.parametrize(
    ("family", "targets", "options", "match"),
    [
        ("qwen3_moe", ("gate_proj",), {}, r"lora targets \['gate_proj'\] match no weight"),
        ("deepseek_v3", ("q_proj",), {}, r"lora targets \['q_proj'\] match no weight"),
    ],
    ids=["unknown", "mla-attention"],
)
def test_refused(hf_families, family, targets, options, match):
    _, path = hf_families.hf(family)
    mesh = fam.mesh(options.pop("mesh", "d2e4"))
    with pytest.raises(ConfigError, match=match):
        models.from_pretrained(path, mesh=mesh, lora=Lora(2, 4.0, targets), **options)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_adapters_train_through_a_pipeline(hf_families, family, tmp_path):
    """On pipe x expert the adapters run in the pipeline's forward (PEFT's logits on
    transformers' model) and train through its schedule, the base weights and the head its
    frozen leaves: the loss and every adapter's gradient equal those on data x expert (no
    pipeline; the same 2 microbatches), nothing else gets one, and adamw steps move the
    adapters alone. DeepSeek-V3's dense layer runs ahead of the stages with its own adapters
    (their gradients come back through the pipeline's input gradients); Qwen3-MoE has none."""
    torch_model, path = hf_families.hf(family, "pipe")
    runs = {}
    for mesh_name in ("d2e4", "p2e4"):
        model, params = models.from_pretrained(
            path, mesh=fam.mesh(mesh_name), dtype=np.float32, num_microbatches=2,
            lora=Lora(4, 8.0, CASES[family]), router_aux_loss_coef=0.0,
        )  # fmt: skip
        runs[mesh_name] = model, fam.randomized_adapters(model, params)
    model, params = runs["p2e4"]
    out = models.save_adapter(model, params, tmp_path / "adapter")
    tuned = peft.PeftModel.from_pretrained(copy.deepcopy(torch_model), str(out)).eval()
    tokens = fam.random_tokens(16, seed=4)
    fam.check_logits(model, params, tuned, tokens[:8], "pipe lora")
    targets = np.roll(tokens, -1, axis=1)
    got = {}
    for mesh_name, (m, p) in runs.items():
        loss, grads = jax.jit(m.loss_and_grads)(p, *m.place_batch(tokens, targets))
        got[mesh_name] = float(loss), grads
    (l1, g1), (l2, g2) = got["d2e4"], got["p2e4"]
    np.testing.assert_allclose(l2, l1, rtol=2e-6)
    leaves = jax.tree_util.tree_leaves_with_path(g1)
    assert leaves and all("_lora_" in jax.tree_util.keystr(w) for w, _ in leaves)
    assert jax.tree.structure(g2) == jax.tree.structure(g1)
    for (where, a), b in zip(leaves, jax.tree.leaves(g2), strict=True):
        what = jax.tree_util.keystr(where)
        a, b = np.asarray(a), np.asarray(b)
        scale = float(np.abs(a).max())
        assert scale > 0, what
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-6 * scale, err_msg=what)
    opt = optax.adamw(1e-2)
    step = model.train_step(opt)
    state = model.init_optimizer(opt, params)
    before = jax.tree_util.tree_leaves_with_path(jax.tree.map(np.asarray, params))
    new, _, _ = step(params, state, *model.place_batch(tokens, targets))  # params donated
    for (where, old), p in zip(before, jax.tree.leaves(new), strict=True):
        moved = not np.array_equal(old, np.asarray(p))
        assert moved == ("_lora_" in jax.tree_util.keystr(where)), jax.tree_util.keystr(where)


def test_adapter_dropout_through_a_pipeline_is_refused(hf_families):
    _, path = hf_families.hf("qwen3_moe", "pipe")
    model, params = models.from_pretrained(
        path, mesh=fam.mesh("p2e4"), dtype=np.float32, num_microbatches=2,
        lora=Lora(4, 8.0, ("q_proj",), dropout=0.1),
    )  # fmt: skip
    tokens = model.place_batch(fam.random_tokens(8, seed=2))
    with pytest.raises(ConfigError, match=r"^jaxops.models.MoEDecoder.loss_and_grads: lora drop"):
        model.loss_and_grads(params, tokens, tokens, dropout_key=jax.random.key(0))


def test_save_pretrained_and_save_adapter_refusals(hf_families, tmp_path):
    _, _, model, params = _load(hf_families, "mixtral", CASES["mixtral"])
    with pytest.raises(ConfigError, match=r"^jaxops\.models\.save_pretrained: .*save_adapter"):
        models.save_pretrained(model, params, tmp_path / "full")
    plain = dataclasses.replace(model, lora=None)
    with pytest.raises(ConfigError, match=r"^jaxops\.models\.save_adapter: the model has no"):
        models.save_adapter(plain, params, tmp_path / "none")
    out = models.save_adapter(model, params, tmp_path / "a")
    other = dataclasses.replace(model, lora=Lora(8, 8.0, CASES["mixtral"]))
    with pytest.raises(ConfigError, match=r"holds other adapters: r=4 \(the model's 8\)"):
        models.load_adapter(other, other.add_adapters(params, jax.random.key(0)), out)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe", "llama4_text"])
def test_merge_then_save_pretrained_loads_in_transformers(hf_families, family, tmp_path):
    """merge_adapter folds every adapter into its weight (the q/k/v parts of w_qkv, the MLPs'
    gate and up halves): the merged plain model computes the adapted logits, and
    save_pretrained's checkpoint loads in transformers with the same logits."""
    transformers = pytest.importorskip("transformers")
    _, _, model, params = _load(hf_families, family, lora_targets_of(family))
    params = fam.randomized_adapters(model, params, seed=6)
    tokens = fam.random_tokens(8, seed=7)
    want = jax.jit(model.logits)(params, model.place_batch(tokens))
    plain, merged = models.merge_adapter(model, params)
    assert plain.lora is None and not any(
        "_lora_" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(merged)
    )
    got = jax.jit(plain.logits)(merged, plain.place_batch(tokens))
    assert fam.max_rel_err(got, want) < 1e-5
    models.save_pretrained(plain, merged, tmp_path / "merged")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        theirs = reloaded(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    assert fam.max_rel_err(want, theirs) < fam.TOL


def lora_targets_of(family: str) -> tuple[str, ...]:
    """Every LoRA target the family's tiny model has."""
    from jaxops.models._adapters import lora_targets

    return lora_targets(models.DecoderConfig.from_hf(fam.hf_config(family).to_dict()))


def test_adapter_gradients_are_the_chain_rule_of_the_merged_weights(hf_families):
    """dL/dA = scaling dL/dW B^T and dL/dB = scaling A^T dL/dW, with dL/dW the plain model's
    gradient at the merged weights: for the q part of w_qkv and every expert's w_in."""
    _, _, model, params = _load(hf_families, "qwen3_moe", ("q_proj", "experts.gate_up_proj"))
    params = fam.randomized_adapters(model, params, seed=8)
    tokens = fam.random_tokens(16, seed=9)
    batch = model.place_batch(tokens, np.roll(tokens, -1, axis=1))
    _, grads = jax.jit(model.loss_and_grads)(params, *batch)
    plain, merged = models.merge_adapter(model, params)
    _, full = jax.jit(plain.loss_and_grads)(merged, *batch)
    s = model.lora.scaling
    lay, g, gw = params["layers"], grads["layers"], full["layers"]
    q = model.config.attention.q_size
    d_q = np.asarray(gw["w_qkv"])[..., :q]  # [L, D, q]
    a, b = np.asarray(lay["q_proj_lora_a"]), np.asarray(lay["q_proj_lora_b"])
    np.testing.assert_allclose(
        g["q_proj_lora_a"], s * d_q @ b.swapaxes(-1, -2), rtol=2e-3, atol=1e-6
    )
    np.testing.assert_allclose(
        g["q_proj_lora_b"], s * a.swapaxes(-1, -2) @ d_q, rtol=2e-3, atol=1e-6
    )
    d_in = np.asarray(gw["moe"]["w_in"])  # [L, E, H, 2F]
    a, b = np.asarray(lay["moe"]["w_in_lora_a"]), np.asarray(lay["moe"]["w_in_lora_b"])
    want_a, want_b = s * d_in @ b.swapaxes(-1, -2), s * a.swapaxes(-1, -2) @ d_in
    np.testing.assert_allclose(g["moe"]["w_in_lora_a"], want_a, rtol=2e-3, atol=1e-6)
    np.testing.assert_allclose(g["moe"]["w_in_lora_b"], want_b, rtol=2e-3, atol=1e-6)


def test_peft_written_adapters_load(hf_families, tmp_path):
    """PEFT writes (its own LoRA on transformers' model, B not zero), jaxops reads: the same
    logits; PEFT features jaxops does not build are refused naming the key, a tensor of
    another shape naming the tensor."""
    torch_model, _, model, params = _load(
        hf_families, "qwen3_moe", ("q_proj", "o_proj", "experts.gate_up_proj", "router")
    )
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.gate.weight"],
        init_lora_weights=False,  # random B: an adapter that changes the logits
    )
    torch.manual_seed(0)
    tuned = peft.get_peft_model(copy.deepcopy(torch_model), config).eval()
    tuned.save_pretrained(tmp_path / "peft")
    loaded = models.load_adapter(model, params, tmp_path / "peft")
    fam.check_logits(model, loaded, tuned, fam.random_tokens(8, seed=11), "peft-written adapter")
    assert float(jnp.abs(loaded["layers"]["q_proj_lora_b"]).max()) > 0

    import json

    from jaxops.parallel.checkpoint import CheckpointError

    written = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text(
        json.dumps({**written, "use_dora": True})
    )
    with pytest.raises(ConfigError, match="use_dora = True"):
        models.load_adapter(model, params, tmp_path / "dora")
    out = models.save_adapter(model, params, tmp_path / "ours")
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(out / "adapter_model.safetensors"))
    key = next(k for k in tensors if "o_proj.lora_B" in k)
    tensors[key] = tensors[key][:, :2]
    save_file(tensors, str(out / "adapter_model.safetensors"))
    with pytest.raises(CheckpointError, match=f"{re.escape(key)} has shape"):
        models.load_adapter(model, params, out)


# -------------------------------------------------------------------------------------------------
# Dropout on the adapters' inputs (PEFT's lora_dropout).


def test_adapter_dropout_drops_the_input_elements():
    """``adapted`` with a key: ``scaling * (dropout(x) @ A) @ B`` with A and B identities reads
    the dropped-out input back: each element 0 or ``x / keep``, about `keep` of them kept, a mask
    of its own per adapter name; without a key (evaluation) nothing is dropped."""
    from jaxops.models import _ops

    ops = _ops.Ops(jnp.float32, None, None, None, "xla", 1.0, 0.25)
    x = jnp.asarray(np.random.default_rng(0).uniform(1, 2, (64, 16)), jnp.float32)
    p = {"q_proj_lora_a": jnp.eye(16), "q_proj_lora_b": jnp.eye(16), "k_proj_lora_a": jnp.eye(16)}
    p["k_proj_lora_b"] = jnp.eye(16)
    zero = jnp.zeros((64, 16))
    assert np.array_equal(np.asarray(_ops.adapted(ops, p, "q_proj", x, zero)), np.asarray(x))
    keyed = {**p, _ops.DROPOUT_KEY: jax.random.key(3)}
    q = np.asarray(_ops.adapted(ops, keyed, "q_proj", x, zero))
    k = np.asarray(_ops.adapted(ops, keyed, "k_proj", x, zero))
    kept = q != 0
    np.testing.assert_allclose(q[kept], np.asarray(x)[kept] / 0.75, rtol=1e-6)
    assert 0.7 < kept.mean() < 0.8 and not np.array_equal(kept, k != 0)
    again = np.asarray(_ops.adapted(ops, keyed, "q_proj", x, zero))
    assert np.array_equal(q, again)  # the same key, the same mask


def test_dropout_in_the_training_step(tmp_path):
    """Only the attention's adapters take dropout (PEFT's target_modules; it refuses a dropout
    on target_parameters): with expert adapters alone the loss is the loss without dropout.
    With attention adapters the same key gives the same loss, another key another; fresh
    adapters (B zero) are unchanged by it; dropout 0 ignores the key; the key is required."""
    cfg = models.DecoderConfig(
        "qwen3_moe", vocab_size=64, hidden_size=32, num_layers=2,
        attention=models.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8),
        moe=models.MoESpec(num_experts=4, top_k=2, expert_ffn=16),
    )  # fmt: skip
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    tokens = np.random.default_rng(1).integers(0, 64, (2, 8)).astype(np.int32)

    built = {}  # (targets, dropout) -> (model, its jitted loss_and_grads): one compile each

    def loss(targets, dropout, key, fresh=False):
        if (targets, dropout) not in built:
            model = models.MoEDecoder(cfg, mesh, lora=Lora(4, 8.0, targets, dropout=dropout))
            built[targets, dropout] = model, jax.jit(model.loss_and_grads)
        model, step = built[targets, dropout]
        params = model.init(jax.random.key(0))
        if not fresh:
            params = fam.randomized_adapters(model, params)
        return float(step(params, tokens, tokens, dropout_key=key)[0])

    experts = ("experts.gate_up_proj", "experts.down_proj")
    assert loss(experts, 0.5, jax.random.key(1)) == loss(experts, 0.0, None)
    attention = ("q_proj", "v_proj", "o_proj")
    one, same = loss(attention, 0.5, jax.random.key(1)), loss(attention, 0.5, jax.random.key(1))
    other, none = loss(attention, 0.5, jax.random.key(2)), loss(attention, 0.0, jax.random.key(1))
    assert one == same and one != other and one != none
    assert none == loss(attention, 0.0, None)
    assert loss(attention, 0.5, jax.random.key(1), fresh=True) == loss(attention, 0.0, None, True)
    raw = jax.random.key_data(jax.random.key(1))  # a raw uint32[2] key is the same key
    assert loss(attention, 0.5, raw) == one
    model = models.MoEDecoder(cfg, mesh, lora=Lora(4, 8.0, attention, dropout=0.1))
    params = model.init(jax.random.key(0))
    # PEFT's adapter_config carries the dropout, but not with target_parameters (it refuses)
    import json

    out = models.save_adapter(model, params, tmp_path / "attention")
    assert json.loads((out / "adapter_config.json").read_text())["lora_dropout"] == 0.1
    both = dataclasses.replace(model, lora=Lora(4, 8.0, (*attention, *experts), dropout=0.1))
    out = models.save_adapter(both, both.init(jax.random.key(0)), tmp_path / "both")
    assert json.loads((out / "adapter_config.json").read_text())["lora_dropout"] == 0.0
    with pytest.raises(jaxops.InvalidArgumentError, match="dropout_key is required"):
        model.loss_and_grads(params, tokens, tokens)
    with pytest.raises(jaxops.InvalidArgumentError, match=r"dropout_key must be one .*\[3\]"):
        model.loss_and_grads(params, tokens, tokens, dropout_key=np.zeros(3, np.uint32))
    with pytest.raises(ConfigError, match=r"^jaxops.Lora: dropout must be a number in \[0, 1\)"):
        Lora(4, 8.0, attention, dropout=1.0)
