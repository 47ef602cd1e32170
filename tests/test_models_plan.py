"""``python -m jaxops.models.plan``: the ahead-of-time memory plan, and the published configs.

The parameter count of every config in examples/configs is checked against transformers' own
model built from the same file (on the meta device: nothing allocated) and the published total.
"""

import functools
import json
import math
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jaxops.models import plan
from jaxops.models._hlo import collective_traffic

import jaxops
from jaxops import models
from jaxops.testing import child_environ

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "examples" / "configs"
# Published totals (the model cards; main model only: no MTP layers, no vision tower).
PUBLISHED = {
    "deepseek-v3": 671e9,
    "kimi-k2": 1.04e12,
    "glm-4.5": 355e9,
    "gpt-oss-120b": 116.8e9,
    "gpt-oss-20b": 20.9e9,
    "llama4-maverick": 400e9,
    "llama4-scout": 107.8e9,
    "mixtral-8x22b": 140.6e9,
    "qwen2-57b-a14b": 57.4e9,
    "qwen3-235b-a22b": 235e9,
    "qwen3-30b-a3b": 30.5e9,
}


def _hf_count(path: pathlib.Path) -> int:
    """transformers' parameters (and the router correction biases we hold as parameters)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    return n + sum(b.numel() for k, b in model.named_buffers() if "correction_bias" in k)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_parameter_count(name):
    """The main model's count is transformers'; the MTP modules (which transformers does not
    build) are its last MoE layer plus enorm, hnorm, eh_proj [H, 2H] and the head's norm."""
    cfg = models.read_config(CONFIGS / name)
    model = models.MoEDecoder(cfg, jax.make_mesh((1,), ("expert",)))
    params = model.abstract_params()
    ours = plan.count_params({k: v for k, v in params.items() if k != "mtp"})
    assert ours == _hf_count(CONFIGS / name)
    assert abs(ours / PUBLISHED[name] - 1) < 0.015, (ours, PUBLISHED[name])
    layer = plan.count_params(model.layout.weight_shapes()["layers"]) // len(cfg.moe_layers)
    h = cfg.hidden_size
    assert plan.count_params(params.get("mtp", {})) == cfg.mtp_layers * (layer + 2 * h * h + 3 * h)
    assert cfg.mtp_layers == {"deepseek-v3": 1, "glm-4.5": 1}.get(name, 0)


def _tiny(tmp_path) -> pathlib.Path:
    cfg = models.DecoderConfig(
        "qwen3_moe",
        vocab_size=96,
        hidden_size=64,
        num_layers=2,
        attention=models.AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True),
        moe=models.MoESpec(num_experts=8, top_k=2, expert_ffn=32),
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    return tmp_path


def _run(*args: str) -> subprocess.CompletedProcess:
    # The suite's compiler flags (fast compile on CPU machines) pass through; the child sets its
    # own device count.
    env = child_environ()
    return subprocess.run(
        [sys.executable, "-m", "jaxops.models.plan", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd="/",
    )


def test_plan_command_json(tmp_path):
    path = _tiny(tmp_path)
    out = {}
    for zero in (0, 3):
        done = _run(
            str(path),
            "--mesh",
            "data=2,expert=4",
            "--zero",
            str(zero),
            "--batch",
            "8",
            "--seq",
            "16",
            "--device-memory",
            "100KB",  # less than the optimizer state alone: never fits, whatever XLA's temps
            "--json",
        )
        assert done.returncode == 0, done.stderr
        out[zero] = json.loads(done.stdout.strip().splitlines()[-1])
        assert "per device:" in done.stdout
    model = models.MoEDecoder(models.read_config(path), jax.make_mesh((1,), ("expert",)))
    assert out[0]["params"] == out[3]["params"] == plan.count_params(model.abstract_params())
    # float32 parameters: every device holds the attention etc. whole and 1 / 4 of the experts
    shapes = model.param_shapes()
    expert = sum(
        math.prod(s)
        for s in jax.tree.leaves(shapes["layers"]["moe"], is_leaf=lambda s: isinstance(s, tuple))
        if len(s) == 4
    )
    assert out[0]["bytes_per_device"]["params"] == 4 * (out[0]["params"] - expert + expert // 4)
    by0, by3 = out[0]["bytes_per_device"], out[3]["bytes_per_device"]
    assert by3["params"] < by0["params"] / 2 and by3["optimizer"] < by0["optimizer"] / 2
    assert by0["optimizer"] == 2 * by0["params"] + 4  # Adam's two moments and its step count
    for r in out.values():
        by = r["bytes_per_device"]
        assert by["total"] >= by["params"] + by["optimizer"] + by["temp"]
        assert r["fits"] is False and r["device_memory"] == 10**5
        assert r["collective_bytes"] > 0 and r["compile_s"] > 0
        assert set(r["collectives"]) >= {"all-to-all", "all-reduce"}
    assert (
        out[3]["collectives"]["all-gather"]["count"]
        > out[0]["collectives"].get("all-gather", {"count": 0})["count"]
    )


def test_plan_command_pipeline_fp8_remat(tmp_path):
    """A pipe axis (its default microbatches), block FP8 and remat of the projections."""
    done = _run(
        str(_tiny(tmp_path)),
        "--mesh",
        "pipe=2,data=2,expert=2",
        "--zero",
        "1",
        "--fp8",
        "block",
        "--remat",
        "matmuls",
        "--batch",
        "8",
        "--seq",
        "128",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert (r["microbatches"], r["fp8"], r["remat"], r["zero"]) == (2, "block", "matmuls", 1)
    assert r["collectives"]["collective-permute"]["count"] > 0  # the stages' sends
    assert r["fits"] is True


def test_plan_command_bad_mesh(tmp_path):
    done = _run(str(_tiny(tmp_path)), "--mesh", "data=2", "--batch", "8", "--seq", "16")
    assert done.returncode == 2
    assert "needs an 'expert' axis" in done.stderr
    done = _run(str(_tiny(tmp_path)), "--mesh", "data=2,expert=3", "--batch", "6", "--seq", "16")
    assert done.returncode == 2 and "must be divisible by the size 3" in done.stderr, done.stderr
    assert plan.parse_mesh("pipe=2,data=2,expert=4") == {"pipe": 2, "data": 2, "expert": 4}
    with pytest.raises(ValueError, match="AXIS=SIZE"):
        plan.parse_mesh("data=0,expert=2")
    assert plan.parse_bytes("80GB") == 80 * 10**9 and plan.parse_bytes("1 GiB") == 2**30
    with pytest.raises(ValueError, match="--device-memory"):
        plan.parse_bytes("lots")


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_plan_of_lora_on_a_bf16_and_an_fp8_base(tmp_path):
    """LoRA: optimizer state and gradients of the adapters alone; the FP8 base's parameter
    bytes under the bfloat16 base's (one byte a base weight plus its scales)."""
    path = _tiny(tmp_path)
    run = functools.partial(
        plan.plan, path, {"data": 2, "expert": 4}, batch=8, seq=16, param_dtype="bfloat16"
    )
    lora, qlora = run(lora=4), run(lora=4, base="fp8")
    assert lora["lora"]["rank"] == 4 and "experts.gate_up_proj" in lora["lora"]["targets"]
    assert qlora["base"] == "fp8" and lora["base"] is None
    assert lora["trained_params"] == qlora["trained_params"] < lora["params"] / 5
    by = {"lora": lora["bytes_per_device"], "q": qlora["bytes_per_device"]}
    # full fine-tuning's: Adam's two moments and a gradient of every parameter
    assert by["lora"]["optimizer"] < 2 * by["lora"]["params"] / 5
    assert by["lora"]["gradients"] < by["lora"]["params"] / 5
    assert by["q"]["optimizer"] == by["lora"]["optimizer"]
    assert by["q"]["params"] < 0.8 * by["lora"]["params"]
    # through a pipeline (2 stages): the same adapters, each stage's half of them per device
    piped = plan.plan(
        path, {"pipe": 2, "expert": 4}, batch=8, seq=16, param_dtype="bfloat16", lora=4,
        base="fp8",
    )  # fmt: skip
    assert piped["trained_params"] == qlora["trained_params"]
    assert piped["bytes_per_device"]["optimizer"] < by["q"]["optimizer"]


def test_plan_refuses_a_batch_the_mesh_cannot_split(tmp_path):
    # Before anything is compiled: the error names --batch and the batch axes' size, not a
    # sharding error of the lowering.
    path = _tiny(tmp_path)
    done = _run(str(path), "--mesh", "data=2,expert=2", "--batch", "3", "--seq", "16")
    assert done.returncode == 2, done.stderr
    assert "error: jaxops.models.plan: --batch (batch=) must be a positive multiple of 4" in (
        done.stderr
    ), done.stderr
    assert "the size 4 of the mesh's batch axes ('data', 'expert'), got 3" in done.stderr
    if jax.device_count() >= 4:  # the function itself, in this process
        with pytest.raises(ValueError, match=r"^jaxops\.models\.plan: --batch .* got 6$") as e:
            plan.plan(path, {"data": 2, "expert": 2}, batch=6, seq=16)
        assert isinstance(e.value, jaxops.InvalidArgumentError)


def test_collective_traffic_counts_loop_trips():
    mesh = jax.make_mesh((8,), ("data",))

    def body(c, x):
        return c + jax.lax.psum(x, "data"), None

    f = jax.shard_map(
        lambda xs: jax.lax.scan(body, jnp.zeros(16), xs)[0],
        mesh=mesh,
        in_specs=jax.P(None, "data"),
        out_specs=jax.P("data"),
    )
    xs = jax.device_put(jnp.ones((5, 128)), jax.NamedSharding(mesh, jax.P(None, "data")))
    text = jax.jit(f).lower(xs).compile().as_text()
    t = collective_traffic(text)
    assert t.counts == {"all-reduce": 5} and t.bytes == {"all-reduce": 5 * 16 * 4}
    assert t.unknown_loops == 0 and t.total == 320


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_plan_with_a_context_axis(tmp_path):
    """context=4 splits each 8192-token sequence over 4 devices: each device's temporaries are
    within 1.3x of a device's holding whole 2048-token sequences (the same mesh shape, the axis
    a data axis), and under half of one holding whole 8192-token sequences; the keys and
    values move by collective-permutes; with a pipe axis too (the keys all-gathered over the
    context axis in the stages, their gradient reduce-scattered) within 1.3x of whole 2048-token
    sequences on the same pipe mesh; a --seq the axis cannot split is refused by name."""
    path = _tiny(tmp_path)
    run = functools.partial(plan.plan, path, param_dtype="float32")
    split_plan = run({"context": 4, "expert": 2}, batch=2, seq=8192)
    split = split_plan["bytes_per_device"]["temp"]
    share = run({"data": 4, "expert": 2}, batch=8, seq=2048)["bytes_per_device"]["temp"]
    whole = run({"data": 4, "expert": 2}, batch=8, seq=8192)["bytes_per_device"]["temp"]
    assert split < 1.3 * share and split < 0.5 * whole
    assert split_plan["collectives"]["collective-permute"]["count"] > 0
    piped = run({"pipe": 2, "context": 2, "expert": 2}, batch=4, seq=4096)
    piped_share = run({"pipe": 2, "data": 2, "expert": 2}, batch=8, seq=2048)
    assert piped["bytes_per_device"]["temp"] < 1.3 * piped_share["bytes_per_device"]["temp"]
    assert piped["collectives"]["reduce-scatter"]["count"] > 0
    with pytest.raises(jaxops.InvalidArgumentError, match=r"--seq \(seq=\) must be a multiple"):
        plan.plan(path, {"context": 4, "expert": 2}, batch=2, seq=4092)
