"""jaxops.models against transformers, every model type from one table (tests/_hf_families.TABLE):
a tiny random model per family made by transformers (every weight random, norms, biases, sinks
and router correction biases included), built, saved and loaded once per session (the
``hf_families`` fixture), and the same suite for each: logits on 1 device, data x expert and
pipe x expert; the loss with ignored labels (-100); pipe x expert gradients against data x
expert's; adamw steps, save_pretrained and transformers' from_pretrained of the result; greedy
generation; the config's round trip. What only one family has is in its own file
(tests/test_models_<family>.py, test_models.py for Mixtral and the Qwens).

Tolerances: float32 logits within the row's tol (1e-4) of the logit scale (max |logit|); the loss
within rtol 2e-5 of transformers'; the pipeline's loss within rtol 2e-6 and every gradient within
rtol 2e-4 (atol 2e-6) and within 1e-4 of its leaf's scale of data x expert's.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import _hf_families as fam  # noqa: E402
from _hf_families import TABLE  # noqa: E402

from jaxops import models  # noqa: E402


@pytest.fixture(scope="module", params=list(TABLE))
def family(request):
    """A TABLE row's name; module scope keeps a family's tests together (its models and
    compilations are made once per process)."""
    return request.param


def _get(obj, dotted: str):
    for key in dotted.split("."):
        obj = obj.get(key, fam.ABSENT) if isinstance(obj, dict) else getattr(obj, key)
    return obj


def _leaf(tree, path: str):
    for key in path.split("/"):
        tree = tree[key]
    return tree


@pytest.mark.parametrize("mesh_name", list(fam.MESHES))
def test_logits_match_transformers(hf_families, family, mesh_name):
    row = TABLE[family]
    if mesh_name not in row.meshes:
        pytest.skip(f"{family} does not run on {mesh_name}")
    run = hf_families.load(family, mesh_name)
    model, params = run.model, run.params
    assert model.config.model_type == family
    assert model.pipe == (2 if mesh_name == "p2e4" else 1)
    # The experts are sharded over the expert axis, the layers over the pipe axis.
    spec = params["layers"]["moe"]["w_in"].sharding.spec
    assert spec[:2] == (("pipe" if mesh_name == "p2e4" else None), "expert")
    if mesh_name == "1dev":  # the row's own model (pipe x expert may load its pipe variant)
        for key, want in row.expect.items():
            assert _get(model.config, key) == want, key
        for path, shape in row.shapes.items():
            assert _leaf(params, path).shape == shape, path
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):  # every tensor read
            assert leaf.dtype == np.float32 and float(np.abs(leaf).max()) > 0, path
    tokens = fam.random_tokens(2 if mesh_name == "1dev" else 16)
    fam.check_logits(
        model,
        params,
        run.torch_model,
        tokens,
        f"{family} {mesh_name}",
        tol=row.tol,
        logits=run.logits,
    )


def test_loss_with_ignored_labels_matches_transformers(hf_families, family):
    run = hf_families.load(family, "d2e4")
    tokens = fam.random_tokens(16, seed=3)
    labels = tokens.copy()
    labels[:, :4] = -100
    labels[1, 7:] = -100
    targets = np.concatenate([labels[:, 1:], np.full((16, 1), -100, np.int32)], axis=1)
    got, _ = run.loss_and_grads(run.params, *run.model.place_batch(tokens, targets))
    assert not run.torch_model.config.output_router_logits  # no load-balancing term
    with torch.no_grad():
        want = run.torch_model(
            torch.tensor(tokens, dtype=torch.long), labels=torch.tensor(labels, dtype=torch.long)
        ).loss.item()
    np.testing.assert_allclose(float(got), want, rtol=2e-5)


# The families whose pipeline stages differ: MLA with a dense layer ahead (deepseek_v3), tied
# embeddings with shared experts (ernie4_5_moe), per-layer sliding windows and sinks (gpt_oss),
# chunked and NoPE layers (llama4_text), plain GQA with q/k norms and tied embeddings
# (qwen3_moe). The stages run the layers every family's logits test checks; mixtral,
# deepseek_v3 and minimax_m2 also train on it (test_adamw_steps_save_pretrained_...: train_mesh).
PIPELINE_FAMILIES = ("deepseek_v3", "ernie4_5_moe", "gpt_oss", "llama4_text", "qwen3_moe")


@pytest.mark.parametrize("family", PIPELINE_FAMILIES)
def test_pipeline_gradients_equal_the_scan_gradients(hf_families, family):
    """pipe x expert (2 stages, 2 microbatches; dense layers ahead of the stages, each stage
    slicing its layers' attention patterns) against data x expert on the same model and batch."""
    tokens = fam.random_tokens(16, seed=4)
    targets = np.roll(tokens, -1, axis=1)
    out = {}
    for mesh_name in ("d2e4", "p2e4"):
        run = hf_families.load(family, mesh_name, variant="pipe")
        loss, grads = run.loss_and_grads(run.params, *run.model.place_batch(tokens, targets))
        out[mesh_name] = float(loss), jax.tree.map(np.asarray, grads)
    (l1, g1), (l2, g2) = out["d2e4"], out["p2e4"]
    np.testing.assert_allclose(l2, l1, rtol=2e-6)
    for (where, a), b in zip(
        jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g2), strict=True
    ):
        what = jax.tree_util.keystr(where)
        scale = max(float(np.abs(a).max()), 1e-6)
        assert float(np.abs(a - b).max()) <= 1e-4 * scale, what
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-6, err_msg=what)
        # Every weight learns but the routers' correction biases (they move the choice only).
        assert (float(np.abs(b).max()) > 0) == (not what.endswith("['router_bias']")), what
    # Tied embeddings: the embedding's gradient adds the input and the output uses.
    assert ("lm_head" in g2) == (not run.model.config.tie_word_embeddings)


def test_adamw_steps_save_pretrained_and_transformers_reload(hf_families, family, tmp_path):
    row = TABLE[family]
    run = hf_families.load(family, row.train_mesh)
    params, losses = fam.adamw_steps(run)
    assert losses[2] < losses[1] < losses[0], losses
    out = tmp_path / "trained"
    names = models.save_pretrained(run.model, params, out, max_shard_size="200KB")
    assert set(row.names) <= set(names), sorted(names)
    saved = fam.saved_config(out)
    want = {"model_type": family, "dtype": "float32", "architectures": [row.model], **row.saved}
    for key, value in want.items():
        assert _get(saved, key) == value, key
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] > 0
    trained = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(trained).__name__ == row.model
    fam.check_logits(
        run.model,
        params,
        trained,
        fam.random_tokens(16, seed=9),
        f"{family} trained {losses}, saved",
        tol=row.tol,
        logits=run.logits,
    )
    # And back in: the written files load into the same parameters.
    _, again = models.from_pretrained(
        out, mesh=run.model.mesh, num_microbatches=run.model.num_microbatches
    )
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_greedy_generate_matches_transformers(hf_families, family):
    run = hf_families.load(family, "1dev", variant="generate")
    fam.check_greedy_generate(run.model, run.params, run.torch_model, seq=TABLE[family].prompt)


def test_blockwise_attention_matches_transformers(hf_families, family):
    """Blockwise attention in blocks of 16 over 40 tokens (3 query and key blocks, the last
    partial; the causal future, and windows and chunks where the family has them, skipped
    block by block): transformers' logits. Greedy generation in blocks of 5: the prefill's
    prompt and the decode steps' KV cache span several blocks, token for token."""
    run = hf_families.load(family, "1dev")
    model = dataclasses.replace(run.model, attention_impl="blockwise", attention_block=16)
    tokens = fam.random_tokens(2, 40, seed=11)
    fam.check_logits(model, run.params, run.torch_model, tokens, "blockwise", TABLE[family].tol)
    gen = hf_families.load(family, "1dev", variant="generate")
    model = dataclasses.replace(gen.model, attention_impl="blockwise", attention_block=5)
    fam.check_greedy_generate(model, gen.params, gen.torch_model, seq=TABLE[family].prompt)


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v3", "llama4_text"])
def test_blockwise_attention_gradients(hf_families, name):
    """Packed documents and padding (segment ids), 3 blocks: the loss and every gradient of
    blockwise attention equal the whole-scores softmax's ("xla"): attention sinks and sliding
    windows (gpt-oss), multi-head latent attention's 192 / 128-wide keys and values (DeepSeek-V3),
    chunked and NoPE layers with temperature tuning (Llama 4)."""
    run = hf_families.load(name, "1dev")
    tokens = fam.random_tokens(2, 40, seed=12)
    segments = np.repeat([[1, 2, 3, 0], [1, 1, 2, 2]], 10, axis=1).astype(np.int32)
    targets = np.where(segments > 0, np.roll(tokens, -1, axis=1), -100)
    out = {}
    for impl in ("xla", "blockwise"):
        model = dataclasses.replace(run.model, attention_impl=impl, attention_block=16)
        batch = model.place_batch(tokens, targets, segments)
        out[impl] = jax.jit(model.loss_and_grads)(run.params, *batch[:2], segment_ids=batch[2])
    (l1, g1), (l2, g2) = out["xla"], out["blockwise"]
    np.testing.assert_allclose(float(l2), float(l1), rtol=2e-6)
    for (where, a), b in zip(
        jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g2), strict=True
    ):
        a, b = np.asarray(a), np.asarray(b)
        scale = max(float(np.abs(a).max()), 1e-6)
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=1e-5 * scale, err_msg=str(where))


def test_blockwise_attention_in_pipeline_stages(hf_families):
    """gpt-oss (sinks, sliding windows) on pipe x expert in blocks of 8 over 40 tokens: the
    blockwise attention inside the pipeline's stages (its custom backward, the sinks'
    gradient included, in the schedule's shard_map) gives data x expert's loss and every
    gradient."""
    tokens = fam.random_tokens(16, 40, seed=13)
    targets = np.roll(tokens, -1, axis=1)
    out = {}
    for mesh_name in ("d2e4", "p2e4"):
        run = hf_families.load("gpt_oss", mesh_name, variant="pipe")
        model = dataclasses.replace(run.model, attention_block=8, num_microbatches=2)
        loss, grads = jax.jit(model.loss_and_grads)(run.params, *model.place_batch(tokens, targets))
        out[mesh_name] = float(loss), grads
    (l1, g1), (l2, g2) = out["d2e4"], out["p2e4"]
    np.testing.assert_allclose(l2, l1, rtol=2e-6)
    for (where, a), b in zip(
        jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g2), strict=True
    ):
        a, b = np.asarray(a), np.asarray(b)
        scale = max(float(np.abs(a).max()), 1e-6)
        np.testing.assert_allclose(b, a, rtol=2e-4, atol=1e-5 * scale, err_msg=str(where))


def test_config_round_trip(hf_families, family):
    """DecoderConfig.from_hf(cfg.to_hf()) == cfg; transformers reads what to_hf writes as the same
    model; the optional keys absent take transformers' defaults."""
    torch_model, path = hf_families.hf(family)
    hf_cfg = torch_model.config.to_dict()
    cfg = models.read_config(path)
    assert cfg == models.DecoderConfig.from_hf(hf_cfg)
    assert models.DecoderConfig.from_hf(cfg.to_hf()) == cfg
    for dtype in (None, "bfloat16"):
        theirs = transformers.AutoConfig.for_model(**cfg.to_hf(dtype))
        assert type(theirs).__name__ == TABLE[family].config
        assert models.DecoderConfig.from_hf(theirs.to_dict()) == cfg
    optional = ("rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling")
    bare = {k: v for k, v in hf_cfg.items() if k not in optional}
    defaults = getattr(transformers, TABLE[family].config)(**bare).to_dict()
    assert models.DecoderConfig.from_hf(bare) == models.DecoderConfig.from_hf(defaults)
