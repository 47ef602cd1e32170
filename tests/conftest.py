"""Test configuration: 8 CPU devices, the installed jaxops, GPU marker handling."""

from __future__ import annotations

import os
import sys

# Test helper modules (tests/_*.py) import as top-level modules under --import-mode=importlib.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Before jax initializes its backends: 8 CPU devices for the sharded tests.
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
# Under pytest-xdist (`pytest -n 2`) each worker is a process: on a GPU, jax's default
# preallocation of 75% of its memory would leave the second worker none.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# With 8 simulated devices on fewer cores, jaxops' CPU calls would run on their calling thread
# (XLA's pool then has a thread per device); 2 threads keep the split over the pool under test.
os.environ.setdefault("JAXOPS_CPU_THREADS", "2")
# On a machine without an NVIDIA GPU, XLA:CPU compiles the suite's programs with LLVM's
# optimizations off: compiling is most of the suite's time on CPU, and -O0 took a third off the
# longest model tests (111 -> 75 s for five of them, 2 cores). Only the code XLA generates is
# affected; jaxops' kernels are C++ built with the module and run as built. XLA's results change
# in rounding only (a small decoder's loss and gradients, float32: the loss identical, gradients
# within 1.5e-8 of the optimized build's). XLA:CPU also emits its fusions with its elemental IR
# emitters instead of its MLIR fusion emitters (--xla_cpu_use_fusion_emitters=false), which took
# the suite from 1193 to 712-779 s on 2 cores (its scatters become loops). Each flag is left
# alone where XLA_FLAGS sets it already, and both on GPU machines (they would reach the GPU
# compiler too). The multi-process tests' processes get them through XLA_FLAGS
# (jaxops.testing.child_environ).
if not os.path.exists("/dev/nvidiactl"):
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", "")]
        + [
            f"{name}={value}"
            for name, value in (
                ("--xla_backend_optimization_level", "0"),
                ("--xla_cpu_use_fusion_emitters", "false"),
            )
            if name not in os.environ.get("XLA_FLAGS", "")
        ]
    ).strip()

import jax
import pytest

jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))

import jaxops  # noqa: E402


def _gpu_ready() -> bool:
    try:
        return bool(jax.devices("gpu")) and jaxops.cuda_available()
    except RuntimeError:
        return False


GPU_READY = _gpu_ready()


def pytest_report_header(config):
    return [
        f"jaxops {jaxops.__version__} from {os.path.dirname(jaxops.__file__)}",
        f"jaxops build: {jaxops.build_info()}",
        f"jax {jax.__version__}, default backend {jax.default_backend()}, GPU tests: "
        + ("run" if GPU_READY else "skipped (no GPU or no CUDA module)"),
    ]


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU and jaxops built with CUDA")
    for item in items:
        if "gpu" in item.keywords and not GPU_READY:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _restore_default_impl():
    before = jaxops.get_default_impl()
    yield
    jax.config.update("jaxops_impl", before)


@pytest.fixture(scope="session")
def hf_families(tmp_path_factory):
    """The tiny transformers models of tests/_hf_families.TABLE, one per family for the whole
    session (per xdist worker): each built and saved once, loaded by jaxops once per mesh, on
    first use (`_hf_families.Session`)."""
    import _hf_families

    return _hf_families.Session(tmp_path_factory.mktemp("hf_families"))


@pytest.fixture
def ragged_on_cpu():
    """ragged_all_to_all lowered on CPU as the expert exchange's exact dense twin, for one test:
    the GPU's ragged exchange runs on the CPU devices, with jax's own typing and transpose rules
    of the primitive in force (XLA:CPU cannot compile the primitive itself)."""
    from jax._src.interpreters import mlir
    from jax._src.lax import parallel as lax_parallel
    from jaxops.parallel.expert import _exchange

    prim = lax_parallel.ragged_all_to_all_p
    table = mlir._platform_specific_lowerings["cpu"]
    saved = table.get(prim)

    def dense(operand, output, *offsets, axis_name, axis_index_groups):
        assert axis_index_groups is None and len(axis_name) == 1, (axis_name, axis_index_groups)
        return _exchange.ragged_all_to_all_dense(
            operand, output, *offsets, axis_name=axis_name[0], chunk=operand.shape[0]
        )

    mlir.register_lowering(prim, mlir.lower_fun(dense, multiple_results=False), platform="cpu")
    try:
        yield
    finally:
        if saved is None:
            table.pop(prim, None)
        else:
            table[prim] = saved


# Fuzzing: random in development, reproducible in CI (CI=true).
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
