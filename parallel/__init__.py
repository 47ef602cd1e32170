"""jaxops.parallel: expert and pipeline parallelism and sharded checkpointing.

- :mod:`jaxops.parallel.expert`: the expert-parallel MoE layer (``MoEConfig``,
  ``init_moe_params``, ``moe_layer``, its dense twin ``moe_layer_reference``).
- :mod:`jaxops.parallel.pipeline`: pipeline parallelism in one jit (``pipeline_step`` with the
  "gpipe", "1f1b" and "interleaved" schedules, ``pipeline_forward``, ``schedule_table``,
  ``plot_schedule``).
- :mod:`jaxops.parallel.checkpoint`: sharded checkpoints in safetensors files (``save``,
  ``restore`` with resharding, ``CheckpointManager`` with async save, retention and a host-side
  EMA, ``export_safetensors`` / ``import_safetensors`` for Hugging Face layouts).

The sources live in the repository's top-level ``parallel/`` folder and are installed as
``jaxops.parallel``; there is no top-level module named ``parallel``. (An editable install puts
the repository root on ``sys.path``, so the folder could be found as ``parallel``: importing it
under that name is refused below instead of shadowing another package.)
"""

if __name__ != "jaxops.parallel":
    raise ImportError(
        f"this is jaxops.parallel and cannot be imported as {__name__!r}; "
        "use `import jaxops.parallel`"
    )

from . import checkpoint, expert, pipeline

__all__ = ["checkpoint", "expert", "pipeline"]
