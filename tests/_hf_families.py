"""Tiny transformers-made MoE models shared by the models tests: one table (TABLE) with a row per
model type jaxops.models loads, the meshes they run on, the relative error the parity tests
measure, and the session's models (Session: the ``hf_families`` fixture of tests/conftest.py
builds, saves and loads each family once per test process).

tests/test_models_families.py runs the parity suite over TABLE; FAMILIES is the older view of
its first three rows (config class, model class, extra config) that other tests iterate.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4  # max |jaxops - transformers| / max |transformers| for float32 logits

COMMON = dict(  # every row's sizes, unless its extra config changes them
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_experts_per_tok=2,
)  # fmt: skip
MESHES = {
    "1dev": ((1,), ("expert",)),
    "d2e4": ((2, 4), ("data", "expert")),
    "p2e4": ((2, 4), ("pipe", "expert")),
}
ABSENT = object()  # in Family.saved: the key is not written


@dataclasses.dataclass(frozen=True)
class Family:
    """A row of TABLE: a tiny random model of one model type and what its tests expect.

    config, model: transformers' config and causal-LM class names, and extra: the tiny config
    (over COMMON) with the test's own keys (EOS / padding ids), all from the family's registry
    entry (:func:`row`). layer_scale: `randomize`'s factor of the layers' weights (clear router
    choices, varied greedy tokens). tol: the logits' relative error bar. meshes: the MESHES the
    logits run on. train_mesh: where the adamw steps before save_pretrained run. pipe: config
    changes for pipe x expert (which needs the dense layers first), {} for the same model;
    generate: config changes of the greedy-generation model and its prompt length. expect:
    DecoderConfig attributes (dotted for nested ones) and shapes: parameter shapes (by "/" path)
    of the loaded model; saved: config.json entries (dotted, ABSENT for keys not written) and
    names: tensor names that save_pretrained writes.
    """

    config: str
    model: str
    extra: dict[str, Any]
    layer_scale: float = 4.0
    tol: float = TOL
    meshes: tuple[str, ...] = tuple(MESHES)
    train_mesh: str = "d2e4"
    pipe: dict[str, Any] = dataclasses.field(default_factory=dict)
    generate: dict[str, Any] = dataclasses.field(default_factory=dict)
    prompt: int = 8
    expect: dict[str, Any] = dataclasses.field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    saved: dict[str, Any] = dataclasses.field(default_factory=dict)
    names: tuple[str, ...] = ()


_SLIDING_FULL = ("sliding_attention", "full_attention")
_IDS = dict(eos_token_id=None, pad_token_id=0)  # no EOS in the tests' generations


def row(model_type: str, test_keys: dict[str, Any] | None = None, **fields: Any) -> Family:
    """The TABLE row of `model_type`: transformers' classes and the tiny config from its family
    registry entry (``jaxops.models.family``), the test's `test_keys` over them, and `fields`."""
    from jaxops.models import family

    f = family(model_type)
    extra = {k: v for k, v in f.tiny.items() if k not in COMMON or COMMON[k] != v}
    return Family(f.transformers_config, f.architecture, {**extra, **(test_keys or {})}, **fields)


_DENSE_FIRST_EXPECT = {"pattern.dense_layers": (0,), "moe_layers": (1, 2), "pattern.dense_ffn": 96,
    "moe.router": "sigmoid", "moe.router_bias": True, "moe.shared_gate": False}  # fmt: skip
_DENSE_FIRST_ROW = dict(
    shapes={"dense_layers/mlp/w_in": (1, 64, 192)},
    saved={"first_k_dense_replace": 1},
    names=("model.layers.0.mlp.gate_proj.weight",
           "model.layers.2.mlp.gate.e_score_correction_bias"),
)  # fmt: skip

# fmt: off
TABLE: dict[str, Family] = {
    # Every layer MoE, GQA 4:2.
    "mixtral": row(
        "mixtral", layer_scale=5.0, train_mesh="p2e4",
        expect={"moe.normalize_topk": True, "moe.shared_ffn": 0, "attention.qk_norm": False},
        names=("model.layers.1.block_sparse_moe.experts.7.w2.weight",)),
    "qwen3_moe": row(
        "qwen3_moe", layer_scale=5.0,
        expect={"attention.qk_norm": True, "tie_word_embeddings": True, "moe.normalize_topk": True},
        names=("model.layers.1.mlp.experts.7.down_proj.weight",
               "model.layers.1.self_attn.k_norm.weight")),
    "qwen2_moe": row(
        "qwen2_moe", layer_scale=5.0,
        expect={"moe.shared_ffn": 48, "moe.shared_gate": True, "attention.qkv_bias": True,
                "moe.normalize_topk": False},
        names=("model.layers.1.mlp.shared_expert_gate.weight",)),
    # Whole-projection q/k norms.
    "olmoe": row(
        "olmoe", _IDS, layer_scale=5.0,
        expect={"attention.qk_norm": True, "attention.qk_norm_width": "projection",
                "moe.normalize_topk": False, "attention.qkv_bias": False, "moe.shared_ffn": 0},
        shapes={"layers/q_norm": (2, 64), "layers/k_norm": (2, 32)},
        saved={"clip_qkv": None, "head_dim": ABSENT},
        names=("model.layers.1.self_attn.q_norm.weight",)),
    # GLM-4.5: half the head rotated, per-head q/k norms, q/k/v biases, 8 experts in 2 groups.
    "glm4_moe": row(
        "glm4_moe", _IDS,
        expect={**_DENSE_FIRST_EXPECT, "rope.partial_rotary_factor": 0.5, "attention.qk_norm": True,
                "attention.qkv_bias": True},
        **_DENSE_FIRST_ROW),
    # DeepSeek-V3: MLA with a q LoRA, interleaved RoPE pairs, 8 experts in 4 groups.
    "deepseek_v3": row(
        "deepseek_v3", _IDS,
        train_mesh="p2e4",  # the dense layer ahead of the pipeline's stages
        expect={**_DENSE_FIRST_EXPECT, "rope.interleave": True}, **_DENSE_FIRST_ROW),
    # MoE layers 1 and 3 (moe_layer_start_index, moe_layer_interval), dense 0, 2 and 4: the
    # pipeline takes MoE layers from 1 on. Interleaved RoPE pairs, a shared expert, tied
    # embeddings, the router's moe_statics.e_score_correction_bias [1, E].
    "ernie4_5_moe": row(
        "ernie4_5_moe", _IDS,
        pipe=dict(moe_layer_interval=1, seed=1),
        # Tied embeddings make the tiny model repeat its input token; generation needs variety.
        generate=dict(tie_word_embeddings=False, seed=1),
        expect={"pattern.dense_layers": (0, 2, 4), "tie_word_embeddings": True,
                "rope.interleave": True,
                "moe.router": "softmax", "moe.router_bias": True, "moe.shared_ffn": 32,
                "moe.shared_gate": False},
        shapes={"layers/moe/router_bias": (2, 8)},
        saved={"moe_layer_start_index": 1, "moe_layer_end_index": 3, "moe_layer_interval": 2,
               "moe_k": 2},
        names=("model.layers.3.mlp.moe_statics.e_score_correction_bias",)),
    # Sliding-window (4 of 12 tokens) and full layers, attention sinks, biases everywhere, YaRN,
    # the clamped SwiGLU (a small swiglu_limit so that the clamp acts).
    "gpt_oss": row(
        "gpt_oss", _IDS,
        expect={"pattern.layer_types": _SLIDING_FULL * 2, "attention.sliding_window": 4,
                "attention.attention_sinks": True, "moe.expert_bias": True,
                "moe.router_logit_bias": True, "attention.qkv_bias": True,
                "moe.activation": "clamped_swiglu", "moe.swiglu_limit": 0.3, "rope.kind": "yarn"},
        shapes={"layers/moe/b_in": (4, 8, 64), "layers/moe/router_logit_bias": (4, 8),
                "layers/sinks": (4, 4)},
        saved={"layer_types": list(_SLIDING_FULL) * 2, "swiglu_limit": 0.3,
               "rope_parameters.rope_type": "yarn"},
        names=("model.layers.3.self_attn.sinks", "model.layers.0.mlp.experts.gate_up_proj_bias",
               "model.layers.1.mlp.router.bias")),
    # Chunked attention (chunks of 4) in the RoPE layers, NoPE full layers 1 and 3 with the
    # attention temperature (a small floor_scale so that it acts), the L2 q/k norm, top-1
    # sigmoid routing weighting the expert's input, a shared expert, MoE layers 1 and 3 (every
    # layer MoE for the pipeline).
    "llama4_text": row(
        "llama4_text", {**_IDS, "bos_token_id": None},
        pipe=dict(interleave_moe_layer_step=1, seed=1),
        prompt=10,  # and 6 new tokens: past two chunk boundaries and the temperature's floor
        expect={"pattern.nope_layers": (1, 3), "attention.attention_chunk_size": 4,
                "rope.interleave": True,
                "pattern.layer_types": ("chunked_attention", "full_attention") * 2,
                "attention.qk_l2_norm": True, "attention.attn_temperature_tuning": True,
                "moe.weight_inputs": True, "moe.router": "sigmoid", "moe.normalize_topk": False,
                "moe.shared_ffn": 32, "pattern.dense_layers": (0, 2)},
        saved={"moe_layers": [1, 3], "no_rope_layers": [1, 0, 1, 0], "floor_scale": 4,
               "intermediate_size_mlp": 48},
        names=("model.layers.1.feed_forward.experts.gate_up_proj",
               "model.layers.2.feed_forward.gate_proj.weight",
               "model.layers.3.feed_forward.shared_expert.down_proj.weight")),
    # Partial RoPE (rotary_dim half the head), whole-projection q/k norms, sigmoid routing.
    "minimax_m2": row(
        "minimax_m2", {**_IDS, "bos_token_id": None},
        train_mesh="p2e4",
        expect={"attention.qk_norm": True, "attention.qk_norm_width": "projection",
                "rope.partial_rotary_factor": 0.5, "moe.router": "sigmoid",
                "moe.router_bias": True, "moe.normalize_topk": True, "moe.shared_ffn": 0},
        shapes={"layers/q_norm": (2, 64), "layers/k_norm": (2, 32)},
        saved={"rope_parameters.partial_rotary_factor": 0.5, "rotary_dim": ABSENT},
        names=("model.layers.1.block_sparse_moe.e_score_correction_bias",)),
}
# fmt: on
FAMILIES = {  # the older tests' view: name -> (config class, model class, extra config)
    name: (TABLE[name].config, TABLE[name].model, TABLE[name].extra)
    for name in ("mixtral", "qwen3_moe", "qwen2_moe")
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


def hf_config(family: str, **changes):
    """transformers' config of TABLE[family], with `changes`."""
    row = TABLE[family]
    return getattr(transformers, row.config)(**{**COMMON, **row.extra, **changes})


def build(family: str, seed: int = 0, layer_scale: float | None = None, **changes):
    """A transformers model of TABLE[family] (config `changes`), every weight random: `randomize`
    with the row's layer_scale unless given."""
    torch.manual_seed(seed)
    model = getattr(transformers, TABLE[family].model)(hf_config(family, **changes))
    return randomize(model, TABLE[family].layer_scale if layer_scale is None else layer_scale)


def published(family: str, *required: str, **config):
    """DecoderConfig.from_hf of transformers' default config of `family` (the published model's
    shapes; `config` changed) given only its model type, sizes and `required` keys: asserted
    equal to the whole config's (the absent keys take transformers' defaults)."""
    from jaxops import models

    full = getattr(transformers, TABLE[family].config)(**config).to_dict()
    keep = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    got = models.DecoderConfig.from_hf({k: full[k] for k in (*keep, *required, *config)})
    assert got == models.DecoderConfig.from_hf(full), family
    return got


def hf_model(family: str, seed: int = 0):
    """A transformers model of `family` with every weight random (norms and biases too), its
    layers' weights as initialized (layer_scale 1)."""
    return build(family, seed, layer_scale=1.0)


@dataclasses.dataclass
class Loaded:
    """A family's model loaded by jaxops on a mesh, with the transformers model it came from and
    the jitted logits and loss_and_grads every test of it shares (one compilation each)."""

    model: Any
    params: Any
    torch_model: Any
    path: Path

    def __post_init__(self):
        self.logits = jax.jit(self.model.logits)
        self.loss_and_grads = jax.jit(self.model.loss_and_grads)


class Session:
    """The table's models of one test process, each made on first use: transformers builds and
    saves a family's model once (`hf`), jaxops loads it once per mesh (`load`)."""

    def __init__(self, root: Path):
        self.root = root
        self._hf: dict[tuple[str, str], tuple[Any, Path]] = {}
        self._loaded: dict[tuple[str, str, str], Loaded] = {}

    def hf(self, family: str, variant: str = "main") -> tuple[Any, Path]:
        """(transformers model, the directory save_pretrained wrote, sharded with an index) of
        `family`; variant "pipe" or "generate": the row's model for that test, the main model
        where the row changes nothing."""
        changes = {"main": {}, "pipe": TABLE[family].pipe, "generate": TABLE[family].generate}
        variant = variant if changes[variant] else "main"
        if (family, variant) not in self._hf:
            model = build(family, **changes[variant])
            model.generation_config.eos_token_id = None  # generate runs max_new_tokens
            path = self.root / f"{family}-{variant}"
            model.save_pretrained(path, max_shard_size="200KB")
            assert (path / "model.safetensors.index.json").is_file()
            self._hf[family, variant] = model, path
        return self._hf[family, variant]

    def load(self, family: str, mesh_name: str, variant: str | None = None) -> Loaded:
        """`hf(family, variant)` loaded by from_pretrained on MESHES[mesh_name] in float32,
        without the load-balancing loss (transformers' loss has none), 2 microbatches on a pipe
        axis; variant None: "pipe" on pipe x expert, else "main"."""
        variant = variant or ("pipe" if mesh_name == "p2e4" else "main")
        torch_model, path = self.hf(family, variant)
        key = (family, mesh_name, str(path))
        if key not in self._loaded:
            micro = 2 if "pipe" in MESHES[mesh_name][1] else 1
            model, params = _models().from_pretrained(
                path, mesh=mesh(mesh_name), dtype=np.float32, num_microbatches=micro,
                router_aux_loss_coef=0.0,
            )  # fmt: skip
            self._loaded[key] = Loaded(model, params, torch_model, path)
        return self._loaded[key]


def _models():
    from jaxops import models

    return models


def mesh(name: str):
    """The mesh of MESHES[name] on the first devices."""
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def random_tokens(batch: int, seq: int = 12, seed: int = 0, vocab: int = 128) -> np.ndarray:
    """int32 random token ids ``[batch, seq]``."""
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq)).astype(np.int32)


def check_logits(model, params, torch_model, ids, what: str, tol=TOL, logits=None) -> float:
    """Our logits of `ids` (with `logits`, a jitted model.logits, where given) equal
    `torch_model`'s within `tol` of max |logit|; returns (and prints) the error."""
    got = (logits or jax.jit(model.logits))(params, model.place_batch(ids))
    with torch.no_grad():
        want = torch_model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    err = max_rel_err(got, want)
    print(f"{what}: max |logit error| / max |logit| = {err:.2e}")
    assert err <= tol, (what, err)
    return err


def adamw_steps(run: Loaded, steps: int = 3):
    """`steps` optax adamw steps of `run`'s jitted loss_and_grads on a learnable batch (the next
    token is the token + 1 mod 16); returns ``(params, losses)``."""
    opt = optax.adamw(3e-3)
    sub = np.random.default_rng(5).integers(0, 16, (16, 12)).astype(np.int32)
    batch = run.model.place_batch(sub, (sub + 1) % 16)

    @jax.jit
    def update(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, losses = run.params, []
    with jax.set_mesh(run.model.mesh):  # for the optimizer's state (explicit mesh axes)
        state = jax.jit(opt.init)(params)
    for _ in range(steps):  # loss_and_grads outside the mesh's context: the tests' compilation
        loss, grads = run.loss_and_grads(params, *batch)
        with jax.set_mesh(run.model.mesh):
            params, state = update(params, state, grads)
        losses.append(float(loss))
    return params, losses


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


def randomized_adapters(model, params, seed: int = 0):
    """`params` with every LoRA adapter leaf random (B not zero: a trained adapter), placed."""
    rng = np.random.default_rng(seed)

    def one(path, x, sharding):
        if "_lora_" not in jax.tree_util.keystr(path):
            return x
        value = rng.normal(size=x.shape) * 0.3 / np.sqrt(x.shape[-2])
        return jax.device_put(value.astype(np.float32), sharding)

    return jax.tree_util.tree_map_with_path(one, params, model.shardings())


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


def saved_config(path: Path) -> dict:
    """The config.json in directory `path`."""
    return json.loads((path / "config.json").read_text())
