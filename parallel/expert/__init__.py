"""Expert-parallel MoE layer in ``shard_map``: router, permute, exchange, grouped FFN, combine.

One jitted layer over a mesh with an expert axis (and optional data axes). The token batch is
sharded over ``(*data_axes, expert_axis)``; expert weights are sharded over the expert axis
(device j of the expert axis holds experts ``j * L .. (j + 1) * L - 1``, ``L = E / N``) and
replicated over the data axes. On every device::

    router (fp32 logits, top-k)          [T, H] -> expert_ids, probs [T, K]
                                         (learned logit bias, softmax or sigmoid scores,
                                          correction bias, group-limited choice, scaling:
                                          Mixtral, Qwen-MoE, DeepSeek-V3, gpt-oss, Llama 4)
    jaxops.moe.permute                   tokens grouped by expert          [T*K, H]
                                         (weight_inputs: rows scaled by their weights)
    exchange along the expert axis       each expert's rows to its device  [R_recv, H]
    grouped FFN (one grouped GEMM)       every local expert at once        [R_recv, H]
                                         (+ per-expert biases)
    exchange back                        rows to the devices they came from
    jaxops.moe.unpermute(probs)          weighted sum per token            [T, H]
                                         (weight_inputs: plain sum)
    + shared expert (optional)           dense FFN on every token, gated or not

The exchange needs no host synchronization: one all-gather of the ``[E]`` int32 row counts along
the expert axis gives every device every offset. Each device then sends, per local expert of each
peer, one slice, and the receiver's buffer comes out already grouped by local expert (expert l's
rows from sender 0, then sender 1, ..., zero-padded to a multiple of ``align``): no second sort
before the grouped GEMM. On GPU the exchange is ``jax.lax.ragged_all_to_all``. XLA:CPU has no
ragged all-to-all; a dense twin reproduces its exact semantics (``exchange="dense"``): each
device packs the rows for every peer back to back, and rounds of one dense ``all_to_all`` of
``[N, block]`` rows plus a scatter move them, ``block`` about 1.25x the rows one device sends
another on average (``Tl * K / N``), as many rounds as the largest transfer needs (known on
every device from the all-gathered counts; one round unless the routing is skewed). Its buffers
are ``N * block`` rows, not the worst case's ``N * Tl * min(K, L)``: DeepSeek-V3's memory plan
on 512 simulated devices (256 on the expert axis) has 55 instead of 197 GB of temporaries.
Off GPU the layer picks the all-gather form (``exchange="gather"``): the expert axis's tokens
and their routing are all-gathered, each device permutes the gathered slots routed to its own
experts (the same receive buffer, grouped by local expert), runs them, sums each token's
weighted outputs in float32, and one reduce-scatter returns every token's sum to its device.
Its collectives move ``N * Tl`` rows whatever the routing, and no packing, loop or scatter
runs; a small capacity can make the dense form's bound ``Tl * min(K, L)`` smaller
than ``Tl``, and then ``"auto"`` takes the dense form. On 8 simulated CPU devices (2 x 4) the
16-expert decoder's train step of benchmarks/bench_models.py went 557 -> 493 ms with the gather
against the one-round dense form (median, A/B of the two builds), and the dense form in rounds
was still 1.10x slower than the gather there (``ab_models.py``, 2026-11-30).
With one device on the expert axis and no capacity (dropless) there is nothing to exchange:
permute pads each expert's group to ``align`` itself, which is the buffer the exchange would
have made, and neither exchange runs (nor the all-gather of the counts).
XLA's ragged_dot computes every group for every row (L times the work, a float32 ``[L, R, K]``
operand). On GPU the grouped GEMMs are jaxops' CUDA custom calls (groups padded to 64 rows;
first run on an H200 on 2026-11-30: at 16 and 128 experts the layer's fwd+bwd took 1.24 and
20.5 ms against 4.0 ms with ragged_dot and 8.7 / 68.4 ms with the loop); without the CUDA
module, ragged_dot while that operand stays under 4 GiB, else the loop over groups described
below. On CPU the groups go through
jaxops' grouped GEMM custom calls, which take groups of any size (``align`` stays the config's;
one call per GEMM and one per weight gradient, the groups' tiles spread over the FFI thread
pool); with ``impl="xla"`` their twin's loop pads them to 32-row tiles (``lcm(align, 32)``).
The buffer holds the bound's rows exactly (not rounded to the tile: the calls take any row
count, and padding the buffer would copy it before the FFN and again after).
``impl="xla"`` (and a GPU without the CUDA module, past ragged_dot's budget) runs their twin:
each group cut into chunks (as many of 8 tiles as fit, then at most 3 of 2 tiles or 1), a loop
over the non-empty groups slicing a group's weights once and running one XLA GEMM per chunk; its
backward computes a chunk's input and weight gradients in the same trip.

Buffer sizes are static and never overflow (``Tl`` tokens per device, N devices on the expert
axis, L local experts; top-k experts of a token are distinct, so a token sends at most
``min(K, L)`` rows to one device)::

    chunk  = Tl * min(K, L)                               rows one device sends another (bound)
    R_recv = N * chunk + L * (align - 1)                  rows one device receives (dropless)
    with a capacity C:  chunk <= L * min(C, Tl),  R_recv <= L * round_up(min(C, N * Tl), align)
    gather: R = N * Tl * K + L * (align - 1)              (with C: <= L * round_up(C, align))

Capacity (``capacity_factor``): ``C = ceil(capacity_factor * T * K / E)`` for the global batch of
T tokens, and expert e keeps its first C slots in global slot order ``t * K + k`` -- exactly the
slots a single device (``jaxops.moe.permute(..., capacity=C)``) keeps, whatever the mesh. The
per-device prefix counts come from one more all-gather of ``[E]`` int32 over the token axes.
Dropped slots contribute zero to their token's output.

Padded or packed batches: ``token_mask=`` (bool, ``x.shape[:-1]``, sharded like x) routes the
masked-out tokens to no expert (expert id -1: no row, no exchange, no capacity), zeroes their
output and gradients, and leaves them out of ``MoEAux``: the losses are means over the unmasked
tokens of the global batch (one more int32 in the aux psum). C still comes from the static T.

Published variants beyond the plain top-k SwiGLU layer (MoEConfig fields): DeepSeek-V3's
sigmoid router, correction bias, groups and shared experts; Qwen2-MoE's gated shared expert;
gpt-oss's experts with biases (``expert_bias``: ``b_in [E, F']``, ``b_out [E, H]``, sharded like
w_in and w_out), clamped SwiGLU with gate and up interleaved (``activation="clamped_swiglu"``,
``swiglu_alpha``, ``swiglu_limit``) and learned router logit bias (``router_logit_bias``:
``router_logit_bias [E]``; its softmax over the top-k logits is router="softmax",
normalize_topk=True); Llama 4's input-weighted experts (``weight_inputs``: each row is scaled by
its weight before the exchange and the outputs are summed unweighted; its router is
router="sigmoid", normalize_topk=False).

The package's modules, by concern:

- ``_config``: :class:`MoESpec` (the layer's architecture), :class:`MoEConfig` (a spec, the
  width and the runtime settings), the choice tuples (:data:`FFN_ACTIVATIONS`, :data:`ROUTERS`,
  :data:`EXCHANGES`, :data:`DISPATCHES`), :class:`MoEAux`, :func:`init_moe_params`,
  :func:`moe_param_specs`;
- ``_routing``: the router, the auxiliary losses, :func:`update_router_bias`;
- ``_ffn``: activations, the grouped GEMMs (bf16 / FP8) and the shared expert;
- ``_exchange``: :func:`exchange_bounds`, the plan, the offsets, the ragged / dense / FP8
  exchanges;
- ``_gather``: the all-gather exchange's routing, capacity and FP8 dispatch;
- ``_layer``: argument checks, the per-device body, :func:`moe_layer`, :data:`STAGES`;
- ``_reference``: :func:`moe_layer_reference`, the dense single-device twin.

Renamed in this release (the old names work, with a DeprecationWarning, until the next one):
the MoEConfig fields ``hidden`` -> ``hidden_size``, ``ffn_hidden`` -> ``expert_ffn``,
``shared_ffn_hidden`` -> ``shared_ffn``, ``normalize_probs`` -> ``normalize_topk``,
``aux_loss_coef`` -> ``router_aux_loss_coef``, ``z_loss_coef`` -> ``router_z_loss_coef``, and
the module attribute ``ACTIVATIONS`` -> ``FFN_ACTIVATIONS`` (the experts' activations, not the
GEMM epilogue's of ``jaxops.gemm``).
"""

from __future__ import annotations

import warnings
from typing import Any

from . import _exchange, _layer, _routing
from ._config import (
    DISPATCHES,
    EXCHANGES,
    FFN_ACTIVATIONS,
    LORA_TARGETS,
    ROUTERS,
    MoEAux,
    MoEConfig,
    MoESpec,
    init_moe_params,
    moe_param_specs,
)
from ._exchange import exchange_bounds
from ._layer import STAGES, moe_layer
from ._reference import moe_layer_reference
from ._routing import update_router_bias

__all__ = [
    "DISPATCHES",
    "EXCHANGES",
    "FFN_ACTIVATIONS",
    "LORA_TARGETS",
    "ROUTERS",
    "STAGES",
    "MoEAux",
    "MoEConfig",
    "MoESpec",
    "exchange_bounds",
    "init_moe_params",
    "moe_layer",
    "moe_layer_reference",
    "moe_param_specs",
    "update_router_bias",
]

# Private names the models' tests, the benchmark and the tests reach for.
_router = _routing.route
_stage_probe = _layer.stage_probe
_ragged_all_to_all_dense = _exchange.ragged_all_to_all_dense

# Deprecated module attributes: old name -> (new name, value).
_DEPRECATED = {"ACTIVATIONS": ("FFN_ACTIVATIONS", FFN_ACTIVATIONS)}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        new, value = _DEPRECATED[name]
        warnings.warn(
            f"jaxops.parallel.expert.{name} is renamed {new} and the old name goes in the next "
            "release",
            DeprecationWarning,
            stacklevel=2,
        )
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_DEPRECATED})
