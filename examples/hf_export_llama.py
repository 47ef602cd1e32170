"""Worked example: a sharded Llama-style tree -> checkpoint -> Hugging Face safetensors -> back.

Builds a small Llama-shaped parameter tree (fused qkv and gate/up kernels, ``[in, out]`` dense
kernels) sharded on 8 simulated CPU devices, saves it with ``jaxops.parallel.checkpoint``,
exports the checkpoint to the ``LlamaForCausalLM`` layout with ``LLAMA_NAME_MAP`` (split into
several files), checks the files with safetensors' own loader, and imports them back into a
differently sharded target.

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
from jaxops.parallel import checkpoint  # noqa: E402

LAYERS, D, F, VOCAB = 2, 64, 176, 512


def llama_tree(rng: np.random.Generator) -> dict:
    def w(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    return {
        "embed": {"embedding": w(VOCAB, D)},
        "layers": {
            str(i): {
                "attn_norm": {"scale": np.ones(D, np.float32)},
                "attn": {"qkv": {"kernel": w(D, 3 * D)}, "out": {"kernel": w(D, D)}},
                "mlp_norm": {"scale": np.ones(D, np.float32)},
                "mlp": {"gate_up": {"kernel": w(D, 2 * F)}, "down": {"kernel": w(F, D)}},
            }
            for i in range(LAYERS)
        },
        "final_norm": {"scale": np.ones(D, np.float32)},
        "lm_head": {"kernel": w(D, VOCAB)},
    }


def spec(a: np.ndarray) -> P:
    """Shard the last axis over "model" and the first over "data" where they divide."""
    if a.ndim == 2:
        return P("data", "model")
    return P("model") if a.shape[0] % 4 == 0 else P()


def main() -> None:
    tree = llama_tree(np.random.default_rng(0))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    params = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec(a))), tree)

    with tempfile.TemporaryDirectory(prefix="jaxops-hf-") as tmp:
        run(Path(tmp), tree, params)


def run(work: Path, tree: dict, params: dict) -> None:
    from safetensors.numpy import load_file

    checkpoint.save(work / "ckpt", params, step=0)
    names = checkpoint.export_safetensors(
        work / "ckpt",
        work / "hf",
        name_map=checkpoint.LLAMA_NAME_MAP,
        max_shard_size="100KB",
        dtype="bfloat16",
    )
    files = sorted(p.name for p in (work / "hf").iterdir())
    print(f"exported {len(names)} tensors to {work / 'hf'}: {files}")

    loaded = {}
    for f in files:
        if f.endswith(".safetensors"):
            loaded.update(load_file(work / "hf" / f))
    q = loaded["model.layers.1.self_attn.q_proj.weight"]
    qkv = tree["layers"]["1"]["attn"]["qkv"]["kernel"]
    assert q.shape == (D, D) and np.array_equal(q, qkv[:, :D].T.astype(q.dtype))
    print(
        "safetensors.numpy.load_file: q_proj = qkv[:, :D].T (bf16), shapes:",
        {k: v.shape for k, v in list(loaded.items())[:4]},
    )

    other = jax.make_mesh((4, 2), ("data", "model"))
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(other, spec(a))),
        tree,
    )
    back = checkpoint.import_safetensors(work / "hf", target, name_map=checkpoint.LLAMA_NAME_MAP)
    worst = max(
        float(np.max(np.abs(np.asarray(b) - a)))
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back), strict=True)
    )
    print(f"imported back on a (4, 2) mesh; largest difference (bf16 rounding): {worst:.2e}")
    assert worst < 1e-2


if __name__ == "__main__":
    main()
