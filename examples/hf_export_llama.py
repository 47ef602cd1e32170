"""Worked example: a sharded Llama-style tree -> checkpoint -> Hugging Face safetensors -> back.

Builds a small Llama 3.2-shaped parameter tree (grouped-query attention, tied embeddings, fused
qkv and gate/up kernels, ``[in, out]`` dense kernels) sharded on 8 simulated CPU devices, saves
it with ``jaxops.parallel.checkpoint``, exports the checkpoint to the ``LlamaForCausalLM`` layout
with ``jaxops.models.llama_name_map(config)`` (split into several files, with config.json; the tied
``lm_head`` is written once, as ``model.embed_tokens.weight``), checks the files with
safetensors' own loader, and imports them back in one call, onto another mesh, with a target
that ``hf_target`` builds from the files' headers.

Run (from anywhere):  python examples/hf_export_llama.py
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax
import numpy as np

jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))

from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jaxops.models import llama_name_map  # noqa: E402
from jaxops.parallel import checkpoint  # noqa: E402

LAYERS, D, F, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 2, 64, 176, 512, 4, 2, 16
CONFIG = {  # what transformers' LlamaConfig(...).to_dict() or a config.json holds
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": D,
    "intermediate_size": F,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
}
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM


def llama_tree(rng: np.random.Generator) -> dict:
    def w(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    embedding = w(VOCAB, D)
    return {
        "embed": {"embedding": embedding},
        "layers": {
            str(i): {
                "attn_norm": {"scale": np.ones(D, np.float32)},
                "attn": {"qkv": {"kernel": w(D, QKV)}, "out": {"kernel": w(D, D)}},
                "mlp_norm": {"scale": np.ones(D, np.float32)},
                "mlp": {"gate_up": {"kernel": w(D, 2 * F)}, "down": {"kernel": w(F, D)}},
            }
            for i in range(LAYERS)
        },
        "final_norm": {"scale": np.ones(D, np.float32)},
        "lm_head": {"kernel": embedding.T.copy()},  # tied: the same values
    }


def spec(a: np.ndarray) -> P:
    """Shard the last axis over "model" and the first over "data" where they divide."""
    if a.ndim == 2:
        return P("data", "model")
    return P("model") if a.shape[0] % 4 == 0 else P()


SPECS = {  # for hf_target: our key templates -> PartitionSpec
    "layers/{i}/{norm}/scale": P("model"),
    "final_norm/scale": P("model"),
    "{matrix:.*}": P("data", "model"),  # every other leaf is a matrix
}


def main() -> None:
    tree = llama_tree(np.random.default_rng(0))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    params = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec(a))), tree)

    with tempfile.TemporaryDirectory(prefix="jaxops-hf-") as tmp:
        run(Path(tmp), tree, params)


def run(work: Path, tree: dict, params: dict) -> None:
    from safetensors.numpy import load_file

    rules = llama_name_map(CONFIG)  # q/k/v sizes (64, 32, 32), lm_head tied
    checkpoint.save(work / "ckpt", params, step=0)
    names = checkpoint.export_safetensors(
        work / "ckpt",
        work / "hf",
        name_map=rules,
        max_shard_size="100KB",
        dtype="bfloat16",
        config={**CONFIG, "dtype": "bfloat16"},
    )
    assert "lm_head.weight" not in names and names.count("model.embed_tokens.weight") == 1
    files = sorted(p.name for p in (work / "hf").iterdir())
    print(f"exported {len(names)} tensors to {work / 'hf'}: {files}")

    loaded = {}
    for f in files:
        if f.endswith(".safetensors"):
            loaded.update(load_file(work / "hf" / f))
    k = loaded["model.layers.1.self_attn.k_proj.weight"]
    qkv = tree["layers"]["1"]["attn"]["qkv"]["kernel"]
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    assert np.array_equal(k, qkv[:, q_size : q_size + kv_size].T.astype(k.dtype))
    print(
        "safetensors.numpy.load_file: k_proj = qkv[:, 64:96].T (bf16), shapes:",
        {k: v.shape for k, v in list(loaded.items())[:4]},
    )

    # One call: the target (shapes from the headers, shardings on another mesh) and the import.
    other = jax.make_mesh((4, 2), ("data", "model"))
    target = checkpoint.hf_target(work / "hf", rules, other, SPECS, dtype=np.float32)
    back = checkpoint.import_safetensors(work / "hf", target, name_map=rules)
    assert back["lm_head"]["kernel"].shape == (D, VOCAB)  # filled from the embedding
    worst = max(
        float(np.max(np.abs(np.asarray(b) - a)))
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back), strict=True)
    )
    print(f"imported back on a (4, 2) mesh; largest difference (bf16 rounding): {worst:.2e}")
    assert worst < 1e-2


if __name__ == "__main__":
    main()
