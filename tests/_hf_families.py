"""Tiny transformers-made MoE models shared by the models tests: the families, their configs,
the meshes they run on, and the relative error the parity tests measure.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4  # max |jaxops - transformers| / max |transformers| for float32 logits

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
)
FAMILIES = {
    # name: (config class, model class, extra config) -- every layer MoE, GQA 4:2
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=8, intermediate_size=48),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=8,
            moe_intermediate_size=32,
            head_dim=16,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    ),
}
MESHES = {
    "1dev": ((1,), ("expert",)),
    "d2e4": ((2, 4), ("data", "expert")),
    "p2e4": ((2, 4), ("pipe", "expert")),
}


def randomize(model, layer_scale: float = 1.0):
    """`model` (transformers) with every weight random: norms, biases, attention sinks and the
    router's correction bias (a parameter or a buffer) moved off their init so a mix-up shows, and
    the layers' other weights times `layer_scale` (clear router choices, varied greedy tokens).
    Returns the model, in eval mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # gpt-oss's gate_up_proj_bias too
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".sinks"):  # gpt-oss's attention sinks: comparable to the scores
                p.copy_(torch.randn_like(p))
            elif ".layers." in name and layer_scale != 1.0:
                p.mul_(layer_scale)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model.eval()


def hf_model(family: str, seed: int = 0):
    """A transformers model of `family` with every weight random (norms and biases too)."""
    cfg_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, cfg_cls)(**COMMON, **extra)
    torch.manual_seed(seed)
    return randomize(getattr(transformers, model_cls)(config))


def mesh(name: str):
    """The mesh of MESHES[name] on the first devices."""
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def random_tokens(batch: int, seq: int = 12, seed: int = 0, vocab: int = 128) -> np.ndarray:
    """int32 random token ids ``[batch, seq]``."""
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq)).astype(np.int32)


def check_logits(model, params, torch_model, ids: np.ndarray, what: str) -> float:
    """Our logits of `ids` equal `torch_model`'s within TOL of max |logit|; returns (and prints)
    the error."""
    got = jax.jit(model.logits)(params, model.place_batch(ids))
    with torch.no_grad():
        want = torch_model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    err = max_rel_err(got, want)
    print(f"{what}: max |logit error| / max |logit| = {err:.2e}")
    assert err <= TOL, (what, err)
    return err


def adamw_steps(model, params, steps: int = 3):
    """`steps` optax adamw steps (one jitted scan of loss_and_grads) on a learnable batch (the
    next token is the token + 1 mod 16); returns ``(params, losses)``."""
    opt = optax.adamw(3e-3)
    sub = np.random.default_rng(5).integers(0, 16, (16, 12)).astype(np.int32)
    batch = model.place_batch(sub, (sub + 1) % 16)

    def step(carry, _):
        loss, grads = model.loss_and_grads(carry[0], *batch)
        updates, state = opt.update(grads, carry[1], carry[0])
        return (optax.apply_updates(carry[0], updates), state), loss

    with jax.set_mesh(model.mesh):
        train = jax.jit(lambda p: jax.lax.scan(step, (p, opt.init(p)), length=steps))
        (params, _), losses = train(params)
    return params, [float(x) for x in losses]


def check_greedy_generate(model, params, torch_model, seq: int = 8, new: int = 6) -> None:
    """Our greedy ``generate`` of a left-padded prompt equals transformers' token for token."""
    from jaxops import models

    prompt = np.random.default_rng(2).integers(1, 128, (2, seq)).astype(np.int32)
    mask = (np.arange(seq)[None, :] >= np.array([[0], [3]])).astype(np.int32)
    prompt = prompt * mask
    got = models.generate(model, params, prompt, new, attention_mask=mask)
    want = hf_generate(torch_model, prompt, mask, new)
    assert len(set(want[:, seq:].ravel())) > 2  # varied tokens: a real comparison
    np.testing.assert_array_equal(np.asarray(got), want)


def max_rel_err(got, want) -> float:
    """max |got - want| / max |want|, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def hf_generate(model, prompt, mask, max_new_tokens: int) -> np.ndarray:
    """transformers' greedy ``generate`` of a (left-padded) int prompt: ``[B, S + new]``."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor(prompt, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out.numpy()


def check_loss(model, params, torch_model, batch: int = 8, seed: int = 3) -> None:
    """Our training loss of a batch (next-token targets, the last one ignored) equals
    transformers' loss with ``labels`` (rtol 2e-5)."""
    tokens = random_tokens(batch, seed=seed)
    with torch.no_grad():
        ids = torch.tensor(tokens, dtype=torch.long)
        want = torch_model(ids, labels=ids).loss.item()
    targets = np.concatenate([tokens[:, 1:], np.full((batch, 1), -100, np.int32)], axis=1)
    got = jax.jit(model.loss)(params, *model.place_batch(tokens, targets))
    np.testing.assert_allclose(float(got), want, rtol=2e-5)


def train_save_reload(model, params, torch_model, out, what: str) -> tuple[list[str], dict]:
    """3 adamw steps lower the loss; ``save_pretrained`` to `out`; transformers loads it as a
    model of `torch_model`'s class whose logits equal ours. Returns (the tensor names written,
    the saved config.json)."""
    import json

    from jaxops import models

    params, losses = adamw_steps(model, params)
    assert losses[2] < losses[1] < losses[0], losses
    names = models.save_pretrained(model, params, out, max_shard_size="200KB")
    trained = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(trained) is type(torch_model), (type(trained), type(torch_model))
    check_logits(
        model, params, trained, random_tokens(16, seed=9), f"{what} trained {losses}, saved"
    )
    return names, json.loads((out / "config.json").read_text())


def pipeline_and_scan_grads(path, tokens=None) -> dict:
    """``loss_and_grads`` of the model in directory `path` on pipe x expert equal data x
    expert's for one batch (loss rtol 1e-5, every gradient leaf within 1e-4 of its scale);
    returns the pipeline's gradients. Without the load-balancing loss, which the pipeline
    computes per microbatch and data x expert over the whole batch."""
    from jaxops import models

    tokens = random_tokens(16, seed=4) if tokens is None else tokens
    targets = np.roll(tokens, -1, axis=1)
    out = {}
    for mesh_name in ("d2e4", "p2e4"):
        model, params = models.from_pretrained(
            path, mesh=mesh(mesh_name), num_microbatches=2, router_aux_loss_coef=0.0
        )
        loss, grads = jax.jit(model.loss_and_grads)(params, *model.place_batch(tokens, targets))
        out[mesh_name] = float(loss), jax.tree.map(np.asarray, grads)
    (l1, g1), (l2, g2) = out["d2e4"], out["p2e4"]
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    for (where, a), b in zip(
        jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g2), strict=True
    ):
        scale = max(float(np.abs(a).max()), 1e-6)
        assert float(np.abs(a - b).max()) <= 1e-4 * scale, jax.tree_util.keystr(where)
    return g2
