"""Train the MoE decoder of moe_transformer.py from scratch: pipeline x data x expert, multi-host.

One jitted train step: 1F1B pipeline (jaxops.parallel.pipeline) over "pipe", batch over "data"
and "expert", experts over "expert" (jaxops.parallel.expert.moe_layer), optax adamw. The data
is a synthetic Markov chain (generated, no downloads; see ``MarkovData``), the same global batch
on every process, each feeding only its addressable shards. Checkpoints: jaxops'
``CheckpointManager`` with async saves and a host-side EMA of the parameters.

Single process, 8 simulated CPU devices (the default mesh is pipe=2, data=2, expert=2)::

    python examples/train_moe.py --steps 100 --ckpt-dir /tmp/moe_ckpt
    python examples/train_moe.py --steps 200 --ckpt-dir /tmp/moe_ckpt --resume

Stop early and resume (the learning-rate schedule spans --steps, so the resumed run follows the
uninterrupted one exactly)::

    python examples/train_moe.py --steps 100 --stop-after 50 --ckpt-dir /tmp/c
    python examples/train_moe.py --steps 100 --ckpt-dir /tmp/c --resume

Multi-host: every process runs this script with the coordinator's address, the process count and
its id (flags, or the environment variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID)::

    python examples/train_moe.py --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0
    python examples/train_moe.py --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 1

or on one machine ``python examples/launch_local.py -n 2 -- --steps 20``. Started by SLURM's
``srun`` (a job step of more than one task; ``examples/launch/slurm.sbatch``) it needs none of
them: ``jax.distributed.initialize()`` reads SLURM's variables (the coordinator on the step's
first node, at a port derived from the job id; the process count and id from the tasks).
CPU processes talk over gloo. Every model and mesh size is a flag (``--help``); the mesh must have
pipe * data * expert = number of devices in all processes.

Output: ``step <i> loss <value>`` lines (every --log-every steps, on process 0), a tqdm bar
with the loss and tokens/s, and ``first loss``, ``final loss`` and timing summary lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any


def _load_model_module():
    """examples/ is not a package: load moe_transformer.py beside this file."""
    name = "moe_transformer"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _config_fields():
    # Importing the model module imports jax but starts no backend: the device count and
    # jax.distributed are still set up after the flags are parsed.
    mt = _load_model_module()
    return mt.Config, dataclasses.fields(mt.Config)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Any]:
    """Flags: one per Config field, then run, checkpoint and multi-host options."""
    config_cls, fields = _config_fields()
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    model = parser.add_argument_group("model, data and optimizer (Config fields)")
    for f in fields:
        default = f.default
        flag = "--" + f.name.replace("_", "-")
        if isinstance(default, bool):
            model.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            model.add_argument(flag, type=type(default), default=default, help=f"({default})")
    run = parser.add_argument_group("run")
    run.add_argument("--ckpt-dir", default=None, help="checkpoint directory (none: no saving)")
    run.add_argument("--save-every", type=int, default=50)
    run.add_argument("--max-to-keep", type=int, default=3)
    run.add_argument(
        "--ema-decay",
        type=float,
        default=0.99,
        help="decay of the params' EMA, updated at each save (every --save-every steps)",
    )
    run.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    run.add_argument(
        "--stop-after", type=int, default=None, help="stop (and save) at this step, < --steps"
    )
    run.add_argument(
        "--eval-ema",
        action="store_true",
        help="at the end, the loss of the params and of their EMA on a held-out batch",
    )
    run.add_argument(
        "--precision-report",
        action="store_true",
        help="print jaxops.precision_report of the loss-and-gradient step, then train",
    )
    run.add_argument("--log-every", type=int, default=10)
    run.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    run.add_argument(
        "--impl",
        choices=("default", "xla"),
        default="default",
        help="jaxops kernels, or their pure-JAX twins everywhere",
    )
    host = parser.add_argument_group("multi-host (flags or environment)")
    host.add_argument("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"))
    host.add_argument(
        "--num-processes", type=int, default=int(os.environ.get("JAX_NUM_PROCESSES", "1"))
    )
    host.add_argument("--process-id", type=int, default=int(os.environ.get("JAX_PROCESS_ID", "0")))
    host.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="CPU devices per process (default: pipe * data * expert / num processes)",
    )
    args = parser.parse_args(argv)
    try:
        cfg = config_cls(**{f.name: getattr(args, f.name) for f in fields})
    except ValueError as e:
        parser.error(str(e))
    return args, cfg


#: What jax.distributed's SLURM detection reads (jax._src.clusters.SlurmCluster).
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                   "SLURM_LOCALID")  # fmt: skip


def slurm_task() -> tuple[int, int] | None:
    """``(tasks, this task's rank)`` inside a SLURM job step of more than one task, else None."""
    if not all(name in os.environ for name in SLURM_VARIABLES):
        return None
    tasks = int(os.environ["SLURM_NTASKS"])
    return (tasks, int(os.environ["SLURM_PROCID"])) if tasks > 1 else None


def slurm_local_devices() -> list[int] | None:
    """The GPUs of this task: all of its node's with one task per node, else None.

    None lets jax choose: one GPU per task, the task's local rank (``SLURM_LOCALID``).
    """
    gpus = os.environ.get("SLURM_GPUS_ON_NODE")
    if os.environ.get("SLURM_NTASKS_PER_NODE") == "1" and gpus:
        return list(range(int(gpus)))
    return None


def init_runtime(args: argparse.Namespace, cfg: Any) -> None:
    """CPU device count and jax.distributed, before anything touches a backend."""
    import jax

    slurm = None if args.coordinator or args.num_processes > 1 else slurm_task()
    if slurm is not None:
        args.num_processes, args.process_id = slurm
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
        raise SystemExit(f"bad --num-processes/--process-id {args.num_processes}/{args.process_id}")
    per_process = args.devices_per_process or max(cfg.devices // args.num_processes, 1)
    jax.config.update("jax_num_cpu_devices", per_process)
    if args.num_processes > 1:
        if not args.coordinator and slurm is None:
            raise SystemExit(
                "--coordinator (or JAX_COORDINATOR_ADDRESS) is needed with >1 process outside "
                "a SLURM job step"
            )
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if slurm is not None:  # the coordinator, count and id from SLURM's variables
            jax.distributed.initialize(
                local_device_ids=slurm_local_devices(),
                initialization_timeout=120,
                heartbeat_timeout_seconds=30,
            )
            return
        jax.distributed.initialize(
            args.coordinator,
            args.num_processes,
            args.process_id,
            initialization_timeout=120,
            heartbeat_timeout_seconds=30,
        )


def main(argv: list[str] | None = None) -> int:
    """Trains; returns the exit code."""
    args, cfg = parse_args(argv)
    init_runtime(args, cfg)

    import jax

    mt = _load_model_module()
    if jax.device_count() != cfg.devices:
        raise SystemExit(
            f"the mesh pipe*data*expert = {cfg.devices} needs that many devices; "
            f"{jax.process_count()} process(es) have {jax.device_count()}"
        )
    mesh = mt.make_mesh(cfg)
    with jax.set_mesh(mesh):
        return train(args, cfg, mesh)


def train(args: argparse.Namespace, cfg: Any, mesh: Any) -> int:
    """The training loop on `mesh` (the current mesh)."""
    import jax
    import numpy as np
    from jaxops.parallel.checkpoint import CheckpointManager

    import jaxops

    mt = _load_model_module()
    if args.impl == "xla":
        jaxops.set_default_impl("xla")
    lead = jax.process_index() == 0

    def say(*a):
        if lead:
            print(*a, flush=True)

    say(
        f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.default_backend()} devices, "
        f"{jax.process_count()} process(es); config {cfg}"
    )
    say(f"jaxops impl: {jaxops.get_default_impl()}, precision: {cfg.precision}")

    optimizer = mt.make_optimizer(cfg)
    model = mt.make_model(cfg, mesh)
    params = model.init(jax.random.key(cfg.seed))
    opt_state = jax.jit(optimizer.init)(params)
    say(f"model: {model.config.model_type} decoder, {mt.param_count(params):,} parameters")

    mgr = None
    start = 0
    if args.ckpt_dir:
        mgr = CheckpointManager(
            args.ckpt_dir,
            max_to_keep=args.max_to_keep,
            async_save=True,
            ema_decay=args.ema_decay,
            ema_subtree="params",
            progress=False,
        )
        if args.resume:
            latest = mgr.latest_step()
            if latest is None:
                say(f"--resume: no checkpoint in {args.ckpt_dir}, starting from scratch")
            else:
                target = jax.tree.map(
                    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                    {"params": params, "opt": opt_state},
                )
                state = mgr.restore(latest, target)
                params, opt_state, start = state["params"], state["opt"], latest
                say(f"resumed from step {latest} in {args.ckpt_dir}")
    elif args.resume:
        raise SystemExit("--resume needs --ckpt-dir")

    step_fn = mt.make_train_step(cfg, model, optimizer)
    data = mt.MarkovData(cfg)
    say(
        f"data: Markov chain over {cfg.vocab} tokens, loss floor ~{data.entropy_rate():.3f} "
        f"(uniform would be {np.log(cfg.vocab):.3f})"
    )
    if args.precision_report:
        batch = model.place_batch(*data.batch(start))
        report = jaxops.precision_report(mt.make_grad_fn(cfg, model), params, *batch)
        say(f"matmuls of the loss-and-gradient step:\n{report}")
    stop = cfg.steps if args.stop_after is None else min(args.stop_after, cfg.steps)
    bar = None
    if lead and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=stop, initial=start, desc="train", unit="step", dynamic_ncols=True)
    first = last = None
    compile_s = 0.0
    times: list[float] = []
    for step in range(start, stop):
        tokens, targets = model.place_batch(*data.batch(step))
        t0 = time.perf_counter()
        params, opt_state, loss = step_fn(params, opt_state, tokens, targets)
        loss = float(loss)  # replicated scalar: every process has it
        dt = time.perf_counter() - t0
        if step == start:
            compile_s = dt
        else:
            times.append(dt)
        first = loss if first is None else first
        last = loss
        done = step + 1
        if bar is not None:
            tps = cfg.tokens_per_step / dt
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}")
            bar.update(1)
        if done % args.log_every == 0 or done == stop or step == start:
            line = f"step {done} loss {loss:.7f}"
            if bar is not None:
                bar.write(line)
            else:
                say(line)
        if mgr is not None and (done % args.save_every == 0 or done == stop):
            mgr.save(done, {"params": params, "opt": opt_state})
    if bar is not None:
        bar.close()
    if mgr is not None:
        mgr.wait()
        say(f"checkpoints: {mgr.all_steps()} in {args.ckpt_dir} (with an EMA of the params)")
        if args.eval_ema and mgr.latest_step() is not None:
            target = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), params
            )
            ema = mgr.restore(None, target, subtree="params", ema=True)
            held_out = model.place_batch(*data.batch(10**9))
            loss_fn = mt.make_grad_fn(cfg, model)
            say(
                f"held-out loss: params {float(loss_fn(params, *held_out)[0]):.4f}, "
                f"EMA (decay {args.ema_decay}) {float(loss_fn(ema, *held_out)[0]):.4f}"
            )
        mgr.close()
    if first is None:
        say(f"nothing to do: already at step {start} of {stop}")
        return 0
    step_s = float(np.median(times)) if times else compile_s
    say(f"first loss {first:.7f} (step {start + 1})")
    say(f"final loss {last:.7f} (step {stop})")
    say(
        f"first step (compile + run) {compile_s:.1f} s; then {step_s * 1e3:.1f} ms/step, "
        f"{cfg.tokens_per_step / step_s:,.0f} tokens/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
