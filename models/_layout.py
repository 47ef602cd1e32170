"""The decoder's parameter layout on its mesh: shapes, specs, shardings, initialization.

:class:`Layout` is the part of :class:`~jaxops.models.MoEDecoder` that says where every
parameter and batch row lives; it reads the decoder's fields (``config``, ``mesh``, ``moe``,
``pipe``, ``moe_impl``, the axes) and holds none itself.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxops.parallel import expert as ep

__all__ = ["Layout"]

_INIT_STD = 0.02  # transformers' initializer_range for these models


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


class Layout:
    """Parameter shapes, PartitionSpecs, shardings, initialization and batch placement."""

    def param_shapes(self) -> dict[str, Any]:
        """The parameter tree's shapes (``layers`` leaves stacked ``[L, ...]``).

        ``embed [V, D]``; per layer ``attn_norm [D]``, ``w_qkv [D, (Hq + 2 Hkv) Dh]`` (q, k, v
        side by side), ``b_qkv`` (Qwen2), ``q_norm, k_norm [Dh]`` (Qwen3; ``[Hq Dh]`` and
        ``[Hkv Dh]`` for OLMoE), ``w_o [Hq Dh, D]``, ``b_o`` (Qwen3 and OLMoE attention_bias),
        ``mlp_norm [D]``, ``moe`` (``MoEConfig.param_shapes``:
        ``router [D, E]``, ``w_in [E, D, 2F]`` (gate, up), ``w_out [E, F, D]``, the shared
        expert); then ``final_norm [D]`` and ``lm_head [D, V]`` (absent with tied embeddings).
        Kernels are ``[in, out]``.
        """
        c = self.config
        d, qkv = c.hidden_size, c.q_size + 2 * c.kv_size
        layer: dict[str, Any] = {"attn_norm": (d,), "w_qkv": (d, qkv)}
        if c.qkv_bias:
            layer["b_qkv"] = (qkv,)
        if c.qk_norm:
            whole = c.qk_norm_width == "projection"
            layer["q_norm"] = (c.q_size,) if whole else (c.head_dim,)
            layer["k_norm"] = (c.kv_size,) if whole else (c.head_dim,)
        layer["w_o"] = (c.q_size, d)
        if c.o_bias:
            layer["b_o"] = (d,)
        layer["mlp_norm"] = (d,)
        layer["moe"] = dict(self.moe.param_shapes)
        stacked = jax.tree.map(
            lambda s: (c.num_layers, *s), layer, is_leaf=lambda s: isinstance(s, tuple)
        )
        tree = {"embed": (c.vocab_size, d), "layers": stacked, "final_norm": (d,)}
        if not c.tie_word_embeddings:
            tree["lm_head"] = (d, c.vocab_size)
        return tree

    def _layer_specs(self, lead: Any) -> dict[str, Any]:
        shapes = self.param_shapes()["layers"]
        specs = {k: P(lead) for k in shapes if k != "moe"}
        moe_specs = ep.moe_param_specs(self.moe)
        if self.moe_impl == "dense":  # every device runs every expert
            moe_specs = {k: P() for k in moe_specs}
        specs["moe"] = {k: P(lead, *s) for k, s in moe_specs.items() if k in shapes["moe"]}
        return specs

    def param_specs(self) -> dict[str, Any]:
        """PartitionSpecs of the parameters.

        Layers over the pipe axis, experts over the expert axis, everything else replicated.
        """
        lead = self.pipe_axis if self.pipe > 1 else None
        specs = {"embed": P(), "layers": self._layer_specs(lead), "final_norm": P()}
        if not self.config.tie_word_embeddings:
            specs["lm_head"] = P()
        return specs

    def shardings(self) -> dict[str, Any]:
        """NamedShardings of :meth:`param_specs` on the mesh."""
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), self.param_specs(), is_leaf=_is_spec
        )

    def abstract_params(self, dtype: Any = jnp.float32) -> dict[str, Any]:
        """The parameter tree as ``jax.ShapeDtypeStruct`` s with their shardings (a load target).

        The MoE correction bias (none of these models has one) would stay float32.
        """
        dtype = np.dtype(dtype)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s, dtype, sharding=sh),
            self.param_shapes(),
            self.shardings(),
            is_leaf=lambda s: isinstance(s, tuple),
        )

    def init(self, key: jax.Array, dtype: Any = jnp.float32) -> dict[str, Any]:
        """Random parameters placed on the mesh.

        normal(0, 0.02) matrices (transformers' initializer_range), unit norms, zero biases.
        """
        abstract = self.abstract_params(dtype)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)

        def make(key):
            keys = jax.random.split(key, len(leaves))
            out = []
            for (path, leaf), k in zip(leaves, keys, strict=True):
                name = jax.tree_util.keystr(path)
                if "norm" in name:
                    out.append(jnp.ones(leaf.shape, leaf.dtype))
                elif name.endswith("['b_qkv']") or name.endswith("['b_o']"):
                    out.append(jnp.zeros(leaf.shape, leaf.dtype))
                else:
                    out.append((jax.random.normal(k, leaf.shape) * _INIT_STD).astype(leaf.dtype))
            return jax.tree_util.tree_unflatten(treedef, out)

        out_shardings = jax.tree.map(lambda a: a.sharding, abstract)
        return jax.jit(make, out_shardings=out_shardings)(key)

    def place_batch(self, *arrays: Any) -> Any:
        """Host arrays ``[B, ...]`` as global arrays split over the batch axes.

        Every process passes the same global values; one array in, one out.
        """
        sharding = NamedSharding(self.mesh, P(self.batch_axes))

        def put(a):
            a = np.asarray(a)
            return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

        out = tuple(put(a) for a in arrays)
        return out[0] if len(out) == 1 else out
