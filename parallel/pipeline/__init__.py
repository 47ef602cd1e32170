"""Pipeline parallelism inside one ``jax.jit``: GPipe, 1F1B and interleaved 1F1B schedules.

The model is a stack of ``L = num_stages * virtual_stages`` stages with one ``stage_fn`` and
stacked parameters. The stages are spread over the ``num_stages`` devices of a mesh axis; the
whole train step (every microbatch's forward, loss and backward) is one ``shard_map`` over the
mesh holding one ``lax.scan`` over the ticks of a static schedule::

    tick t on device d:   forward  F(m, v): x -> stage_fn(params[v], x)   (and the loss, last stage)
                          backward B(m, v): the stage's jax.vjp on dy     (param grads accumulated)
                          or idle
                          then one ppermute of activations to d + 1 and one of gradients to d - 1

Backward is not obtained by differentiating the loop: each ``F`` runs ``jax.vjp`` of its stage
and stashes what the backward needs in a slot of a fixed-size buffer, and the matching ``B``
reads the slot, applies the vjp and frees the slot. What is stashed is set by ``remat``:

- ``remat=False``: the vjp's residuals (no recomputation),
- ``remat=True``: only the stage input (``jax.checkpoint``: the backward recomputes the forward),
- a ``jax.checkpoint_policies`` policy: the residuals that policy saves.

Residuals that are the stage's parameters themselves are never stashed (the backward reads them
from the parameters), and neither are those computed from the parameters alone, such as a slice
or a cast of a weight (the backward recomputes them). The number of slots is the largest number
of microbatches a device holds at once, which the schedule decides:

==============  ================================  =====================================
schedule        order on each device              stashed microbatches per device
==============  ================================  =====================================
"gpipe"         all forwards, then all backwards  ``M * V`` (grows with M)
"1f1b"          warm-up ``P - d - 1`` forwards,   at most ``P`` (independent of M)
                then one forward / one backward
"interleaved"   Megatron-LM's interleaved 1F1B    at most ``2 (P - 1) + (V - 1) P + 1``
                over V chunks per device          microbatch-chunks (independent of M)
==============  ================================  =====================================

With P devices, M microbatches and V virtual stages every schedule takes ``2 (V M + P - 1)``
ticks of one chunk's forward or backward, so its bubble (idle fraction, counting forward and
backward ticks alike) is ``(P - 1) / (V M + P - 1)``; :func:`schedule_table` returns the table and
:func:`plot_schedule` draws it. ``"gpipe"`` with ``virtual_stages > 1`` is the circular schedule
of MaxText and praxis.

Layout of ``stage_params``: every leaf is stacked on a leading axis of size ``L`` that is
sharded over the pipeline axis, so device d holds rows ``d V .. d V + V - 1``. Row ``d V + v``
is model stage ``v P + d`` (round robin, as interleaved and circular schedules need; for V = 1
that is the model order). :func:`interleave` and :func:`deinterleave` convert from and to the
model order.

The batch (``inputs``, ``targets``) is split over ``data_axes`` (by default every other mesh
axis) and each device's share into ``num_microbatches`` microbatches. Gradients of the stage
parameters and of ``loss_params`` accumulate locally over the microbatches and are all-reduced
over the data axes (where they are replicated) once, after the loop, as in plain data
parallelism. Other mesh axes may shard the stage parameters (``param_specs``) -- for example
the expert axis of :func:`jaxops.parallel.expert.moe_layer` stages. The pipeline axis is the
``pipe_axis=`` keyword (``"pipe"`` by default; ``axis=`` is its deprecated old name).

Modules, by concern: ``_schedule`` (schedule checks, device orders, the simulation,
:class:`ScheduleTable`), ``_plot`` (:func:`plot_schedule`), ``_program`` (the per-tick program
and its buffer slots), ``_layout`` (:func:`interleave`), ``_setup`` (argument checks), ``_trees``
(pytree helpers), ``_run`` (the ``shard_map`` body) and ``_step`` (:func:`pipeline_step`,
:func:`pipeline_forward`).
"""

from ._layout import deinterleave, interleave
from ._plot import plot_schedule
from ._schedule import SCHEDULES, ScheduleTable, schedule_table
from ._step import PipelineGrads, pipeline_forward, pipeline_step

__all__ = [
    "SCHEDULES",
    "PipelineGrads",
    "ScheduleTable",
    "deinterleave",
    "interleave",
    "pipeline_forward",
    "pipeline_step",
    "plot_schedule",
    "schedule_table",
]
