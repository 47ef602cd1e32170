"""End-to-end tests of the MoE training example (examples/moe_transformer.py, train_moe.py,
launch_local.py, the SLURM recipe) on ``jaxops.models.MoEDecoder``: the pipelined, expert- and
data-parallel model against a single-device run of the same model, with jaxops' kernels and with
their pure-JAX twins; training, checkpoints and resume; 2 processes against 1; 2 processes
started as a SLURM job step would start them.

Tolerances (float32 throughout): loss and every gradient within ``assert_allclose(float32,
scale=16)``, i.e. rtol = atol = 3.2e-4, for 3 steps of SGD (the parallel run sums in a different
order; measured differences are ~1e-7). FP8 (block recipe), one step: the loss within
``scale=50`` and each gradient within 6% relative Frobenius error, since the parallel run
quantizes the weight gradient's tokens per shard (measured 1e-7 to 2.7e-2). The 2-process run's
losses match the 1-process run to rtol 1e-5 (gloo's reductions vs the in-process ones).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import jaxops
from jaxops.testing import assert_allclose, child_environ, run_processes

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCALE = 16


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


mt = _load("moe_transformer")

# Small enough to compile fast; M = 4 > P = 2 microbatches, so 1F1B has a steady state.
SMALL = dict(
    vocab=32,
    d_model=32,
    heads=2,
    kv_heads=1,
    layers=4,
    experts=4,
    top_k=2,
    d_ff=32,
    seq_len=16,
    batch=16,
    microbatches=4,
)


def _rel_frobenius(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _compare(
    cfg, steps: int = 3, lr: float = 0.3, scale: float = SCALE, frobenius: float | None = None
) -> list[float]:
    model = mt.make_model(cfg, mt.make_mesh(cfg))
    params = model.init(jax.random.key(cfg.seed))
    ref_params = jax.device_get(params)
    par_fn = mt.make_grad_fn(cfg, model)
    ref_fn = mt.make_reference_grad_fn(cfg)
    data = mt.MarkovData(cfg)
    sgd = jax.jit(lambda p, g: jax.tree.map(lambda a, b: a - lr * b, p, g))
    losses = []
    for step in range(steps):
        tokens, targets = data.batch(step)
        loss, grads = par_fn(params, *model.place_batch(tokens, targets))
        ref_loss, ref_grads = ref_fn(ref_params, tokens, targets)
        assert_allclose(loss, ref_loss, np.float32, scale=scale, err_msg=f"loss, step {step}")
        flat = jax.tree_util.tree_leaves_with_path(grads)
        for (path, g), r in zip(flat, jax.tree.leaves(ref_grads), strict=True):
            where = f"step {step} grad {jax.tree_util.keystr(path)}"
            if frobenius is None:
                assert_allclose(g, r, np.float32, scale=scale, err_msg=where)
            else:
                err = _rel_frobenius(g, r)
                print(where, f"relative Frobenius error {err:.2e}")
                assert err < frobenius, (where, err)
        # The pipelined gradients keep the parameters' layout and sharding.
        assert grads["layers"]["moe"]["w_in"].sharding.spec[:2] == ("pipe", "expert")
        assert float(np.abs(np.asarray(grads["layers"]["moe"]["router"])).max()) > 0
        params, ref_params = sgd(params, grads), sgd(ref_params, ref_grads)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("impl", ["default", "xla"])
def test_parallel_matches_single_device(impl):
    """Loss and all gradients of the pipe x data x expert run == the single-device model."""
    cfg = mt.Config(**SMALL)
    if impl == "xla":
        with jaxops.default_impl("xla"):
            losses = _compare(cfg)
    else:
        losses = _compare(cfg)
    assert losses[-1] < losses[0], losses


@pytest.mark.slow
def test_parallel_matches_single_device_fp8():
    """Every feature on: FP8 dense projections (jaxops.fp8.linear) and FP8 expert GEMMs."""
    cfg = mt.Config(**SMALL, fp8=True)
    _compare(cfg, steps=1, scale=50, frobenius=0.06)


def test_optax_train_step_reduces_loss():
    cfg = mt.Config(**SMALL, lr=1e-2, warmup=2, steps=12)
    model = mt.make_model(cfg, mt.make_mesh(cfg))
    with jax.set_mesh(model.mesh):
        params = model.init(jax.random.key(0))
        opt = mt.make_optimizer(cfg)
        state = jax.jit(opt.init)(params)
        step = mt.make_train_step(cfg, model, opt)
        data = mt.MarkovData(cfg)
        losses = []
        for i in range(cfg.steps):
            params, state, loss = step(params, state, *model.place_batch(*data.batch(i)))
            losses.append(float(loss))
    assert losses[-1] < 0.75 * losses[0], losses
    assert params["layers"]["w_qkv"].sharding.spec[0] == "pipe"
    assert isinstance(opt, optax.GradientTransformation)


def test_markov_data_deterministic_and_learnable():
    cfg = mt.Config(**SMALL)
    a, b = mt.MarkovData(cfg), mt.MarkovData(cfg)
    for i in (0, 5):
        for x, y in zip(a.batch(i), b.batch(i), strict=True):
            np.testing.assert_array_equal(x, y)
    tokens, targets = a.batch(0)
    assert tokens.shape == targets.shape == (cfg.batch, cfg.seq_len)
    np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])
    assert a.entropy_rate() < 0.5 * np.log(cfg.vocab)


# -------------------------------------------------------------------------------------------------
# The training script, resume and several processes.

_STEP = re.compile(r"^(?:\[0\] )?step (\d+) loss ([0-9.eE+-]+)$", re.M)


def _losses(out: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in _STEP.findall(out)}


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory) -> str:
    """A persistent compilation cache shared by this module's runs of train_moe.py: the runs of
    one configuration compile the same programs (the resumed run and the uninterrupted one), and
    a cache hit takes about 3 s of a 13 s run instead of 9 s compiling."""
    return str(tmp_path_factory.mktemp("jax-compilation-cache"))


def _train(*args: str, cache: str | None = None, timeout: float = 300) -> str:
    env = child_environ(JAX_PLATFORMS="cpu")
    if cache is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = cache
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_moe.py"), "--no-progress", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


@pytest.mark.slow
def test_train_checkpoint_resume(tmp_path, compile_cache):
    """Loss falls; stop at step 12, resume: the losses continue as in one uninterrupted run."""
    ckpt = str(tmp_path / "ckpt")
    common = ("--steps", "24", "--lr", "1e-2", "--log-every", "1", "--save-every", "6")
    first = _losses(_train(*common, "--stop-after", "12", "--ckpt-dir", ckpt, cache=compile_cache))
    assert sorted(first) == list(range(1, 13))
    assert first[12] < 0.7 * first[1], first
    assert sorted(int(p.name) for p in Path(ckpt).iterdir() if p.name.isdigit())[-1] == 12
    index = (Path(ckpt) / "12" / "index.json").read_text()
    assert '"ema/params/' in index and '"opt/' in index
    out = _train(*common, "--ckpt-dir", ckpt, "--resume", cache=compile_cache)
    assert "resumed from step 12" in out, out
    second = _losses(out)
    assert sorted(second) == list(range(13, 25))
    whole = _losses(_train(*common, cache=compile_cache))
    for step in range(13, 25):
        np.testing.assert_allclose(second[step], whole[step], rtol=1e-5, err_msg=f"step {step}")
    assert second[24] < 0.6 * first[1], (first, second)


@pytest.mark.multiprocess
def test_processes_get_the_xla_flags_but_their_own_device_count(monkeypatch):
    """The suite's fast-compile flags reach the multi-process tests' processes; a parent's host
    device count does not (each process sets its own)."""
    flags = os.environ.get("XLA_FLAGS", "")
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {flags}")
    script = "import os; print(os.environ.get('XLA_FLAGS', ''), '|', jax.device_count())"
    outs = run_processes(script, 2, 2, timeout=120)
    for out in outs:
        got_flags, got_devices = out.strip().splitlines()[-1].split("|")
        assert got_flags.split() == flags.split(), (out, flags)
        assert int(got_devices) == 4, out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_match_one():
    launch_local = _load("launch_local")
    args = ["--steps", "4", "--log-every", "1", "--no-progress"]
    codes, outs = launch_local.launch(2, args, total_devices=8, timeout=300, quiet=True)
    assert codes == [0, 0], "\n----\n".join(outs)
    multi = _losses(outs[0])
    single = _losses(_train(*args))
    assert sorted(multi) == sorted(single) == [1, 2, 3, 4], (multi, single)
    for step in single:
        np.testing.assert_allclose(multi[step], single[step], rtol=1e-5, err_msg=f"step {step}")


def _slurm_job_id() -> int:
    """A SLURM job id whose coordinator port (jax's SlurmCluster: the id mod 4096, counted from
    61440) is free on 127.0.0.1 now."""
    rng = np.random.default_rng()
    for _ in range(100):
        offset = int(rng.integers(4096))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 61440 + offset))
            except OSError:
                continue
        return 4096 * 1000 + offset
    raise AssertionError("no free port in 61440..65535")


@pytest.mark.multiprocess
def test_slurm_job_step_starts_the_processes():
    """examples/train_moe.py as srun starts it (examples/launch/slurm.sbatch): 2 tasks with
    SLURM's variables and no multi-host flag or JAX_* variable; jax.distributed reads the
    coordinator (the step's first node, a port from the job id), the count and the ids, and
    the 2 processes train the 8-device mesh together (both exit 0, 2 steps logged)."""
    job = str(_slurm_job_id())
    base = {k: v for k, v in child_environ(JAX_PLATFORMS="cpu").items() if not k.startswith("JAX_")}
    base["JAX_PLATFORMS"] = "cpu"
    slurm = dict(SLURM_JOB_ID=job, SLURM_STEP_NODELIST="127.0.0.1", SLURM_NTASKS="2",
                 SLURM_NTASKS_PER_NODE="2")  # fmt: skip
    argv = [sys.executable, str(EXAMPLES / "train_moe.py"), "--steps", "2", "--log-every", "1",
            "--no-progress"]  # fmt: skip
    procs = [
        subprocess.Popen(
            argv,
            env={**base, **slurm, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(outs)
    assert "on 8 cpu devices, 2 process(es)" in outs[0], outs[0]
    assert sorted(_losses(outs[0])) == [1, 2], outs[0]


def test_launch_recipes_flags_parse_and_cover_their_devices():
    """examples/launch/: the flags the SLURM script and the Kubernetes Job pass to train_moe.py
    parse into a valid Config whose mesh has exactly the job's GPUs (nodes x GPUs per node;
    pods x GPUs per pod), and the Job's process count is its completions."""
    yaml = pytest.importorskip("yaml")
    train_moe = _load("train_moe")
    script = (EXAMPLES / "launch" / "slurm.sbatch").read_text()
    sbatch = dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)$", script, re.M))
    lines = script.replace("\\\n", " ").splitlines()  # continuation lines joined
    command = shlex.split(next(line for line in lines if line.startswith("srun ")))
    flags = command[command.index("examples/train_moe.py") + 1 :]
    _, cfg = train_moe.parse_args(flags)
    assert cfg.devices == int(sbatch["nodes"]) * int(sbatch["gpus-per-node"])
    service, job = yaml.safe_load_all((EXAMPLES / "launch" / "k8s-indexed-job.yaml").read_text())
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    _, cfg = train_moe.parse_args(container["command"][2:])
    pods = job["spec"]["completions"]
    assert cfg.devices == pods * container["resources"]["limits"]["nvidia.com/gpu"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["JAX_NUM_PROCESSES"] == str(pods) == str(job["spec"]["parallelism"])
    host = f"{job['metadata']['name']}-0.{pod['subdomain']}"
    assert env["JAX_COORDINATOR_ADDRESS"].split(":")[0] == host
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
