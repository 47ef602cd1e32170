"""The error vocabulary, walked over the public API of every tier with bad arguments.

Every exception jaxops raises on bad input is a :class:`jaxops.JaxopsError` and also the builtin
it always was (``ValueError``, ``TypeError``, ``RuntimeError``), and its message starts with the
public dotted name of what the user called, exactly once. The cases are cheap: tiny arrays, no
compiles; each fails in the argument checks before anything is traced.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxops.parallel import checkpoint as ck
from jaxops.parallel import expert as ep
from jaxops.parallel import pipeline as pl

import jaxops
from jaxops import _errors, fp8, moe

X = np.ones((4, 8), np.float32)
CFG = dict(num_experts=2, top_k=1, hidden_size=8, expert_ffn=8)
DECODER = dict(vocab_size=32, hidden_size=16, num_layers=1)
ATTENTION = dict(num_heads=2, num_kv_heads=1, head_dim=8)
MOE = dict(num_experts=2, top_k=1, expert_ffn=8)


def _config(**kw):
    m = _models()
    attention, moe = m.AttentionSpec(**ATTENTION), m.MoESpec(**MOE)
    return m.DecoderConfig("qwen3_moe", **{**DECODER, "attention": attention, "moe": moe, **kw})


def _mesh():
    return jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])


def _models():
    from jaxops import models

    return models


def _decoder():
    models = _models()
    return models.MoEDecoder(_config(), _mesh())


IVE, ATE = jaxops.InvalidArgumentError, jaxops.ArgumentTypeError

# (public name, the call with bad arguments, the exception class, its builtin base)
CASES: list[tuple[str, Callable[[], object], type, type]] = [
    # core
    ("jaxops.rms_norm", lambda: jaxops.rms_norm(jnp.ones(())), IVE, ValueError),
    ("jaxops.rms_norm", lambda: jaxops.rms_norm(np.ones((2, 4), np.int32)), ATE, TypeError),
    ("jaxops.rms_norm", lambda: jaxops.rms_norm(X, eps=-1.0), IVE, ValueError),
    ("jaxops.add_rms_norm", lambda: jaxops.add_rms_norm(X, np.ones((4, 7), np.float32)), IVE,
     ValueError),
    ("jaxops.gemm", lambda: jaxops.gemm(X, np.ones((7, 3), np.float32)), IVE, ValueError),
    ("jaxops.gemm", lambda: jaxops.gemm(X, X.T, activation="tanh"), IVE, ValueError),
    ("jaxops.gemm", lambda: jaxops.gemm(X, X.T.astype(np.float16)), ATE, TypeError),
    ("jaxops.set_default_impl", lambda: jaxops.set_default_impl("cuda"), IVE, ValueError),
    ("jaxops.precision", lambda: jaxops.precision("fast"), IVE, ValueError),
    ("jaxops.fp8.quantize", lambda: fp8.quantize(X, dtype=jnp.int8), ATE, TypeError),
    ("jaxops.fp8.quantize", lambda: fp8.quantize(X, block=(3, 3)), IVE, ValueError),
    ("jaxops.fp8.gemm", lambda: fp8.gemm(X, X), ATE, TypeError),
    ("jaxops.fp8.linear", lambda: fp8.linear(X, X.T, fp8="int4"), IVE, ValueError),
    ("jaxops.fp8.DelayedScaling", lambda: fp8.DelayedScaling(history_len=0), jaxops.ConfigError,
     ValueError),
    ("jaxops.moe.permute",
     lambda: moe.permute(X, np.zeros((3, 1), np.int32), num_experts=2), IVE, ValueError),
    ("jaxops.moe.permute",
     lambda: moe.permute(X, np.zeros((4, 1), np.int32), num_experts=0), IVE, ValueError),
    ("jaxops.moe.permute",
     lambda: moe.permute(X, np.zeros((4, 1), np.int32), num_experts=2.0), ATE, TypeError),
    # parallel
    ("jaxops.parallel.expert.MoEConfig", lambda: ep.MoEConfig(**{**CFG, "top_k": 3}),
     jaxops.ConfigError, ValueError),
    ("jaxops.parallel.expert.MoEConfig",
     lambda: ep.MoEConfig(**CFG, router_aux_loss_coef="x"), ATE, TypeError),
    ("jaxops.parallel.expert.init_moe_params",
     lambda: ep.init_moe_params(jax.random.key(0), {"num_experts": 2}), ATE, TypeError),
    ("jaxops.parallel.expert.moe_layer",
     lambda: ep.moe_layer({}, X, ep.MoEConfig(**CFG), mesh=_mesh()), IVE, ValueError),
    ("jaxops.parallel.pipeline.schedule_table", lambda: pl.schedule_table("1f1b", 0, 4), IVE,
     ValueError),
    ("jaxops.parallel.pipeline.interleave",
     lambda: pl.interleave({"w": np.ones((5, 2))}, num_stages=2, virtual_stages=3), IVE,
     ValueError),
    ("jaxops.parallel.checkpoint.save", lambda: ck.save("/nonexistent/ck", {"a": object()}),
     ATE, TypeError),
    ("jaxops.parallel.checkpoint.restore",
     lambda: ck.restore("/nonexistent/jaxops-no-checkpoint"), ck.CheckpointError, RuntimeError),
    ("jaxops.parallel.checkpoint.CheckpointManager",
     lambda: ck.CheckpointManager("/nonexistent/ckm", max_to_keep=0), IVE, ValueError),
    ("jaxops.parallel.checkpoint.import_safetensors",
     lambda: ck.import_safetensors("/nonexistent/jaxops-no-model", {}), ck.CheckpointError,
     RuntimeError),
    # models
    ("jaxops.models.DecoderConfig",
     lambda: _config(pattern=_models().LayerPattern(dense_layers=(1,), dense_ffn=8)),
     jaxops.ConfigError, ValueError),
    ("jaxops.models.AttentionSpec",
     lambda: _models().AttentionSpec(**{**ATTENTION, "num_kv_heads": 3}),
     jaxops.ConfigError, ValueError),
    ("jaxops.parallel.expert.MoESpec",
     lambda: ep.MoESpec(**{**MOE, "top_k": 3}), jaxops.ConfigError, ValueError),
    ("jaxops.Lora", lambda: jaxops.Lora(4, -1.0, ("w_in",)), jaxops.ConfigError, ValueError),
    ("jaxops.Lora", lambda: jaxops.Lora(4, 1.0, (1,)), ATE, TypeError),
    ("jaxops.models.MoEDecoder.logits",
     lambda: _decoder().logits(None, np.zeros((2, 6), np.float32)), ATE, TypeError),
    ("jaxops.models.MoEDecoder.logits",
     lambda: _decoder().logits(None, np.zeros((2, 6), np.int32),
                               segment_ids=np.full((2, 6), -1, np.int32)), IVE, ValueError),
    ("jaxops.models.MoEDecoder.loss",
     lambda: _decoder().loss(None, np.zeros((2, 6), np.int32), np.full((2, 6), 99, np.int32)),
     IVE, ValueError),
    ("jaxops.models.from_pretrained",
     lambda: _models().from_pretrained("/nonexistent/jaxops-no-model"), jaxops.ConfigError,
     ValueError),
    ("jaxops.models.read_config", lambda: _models().read_config("/nonexistent/jaxops-no-model"),
     jaxops.ConfigError, ValueError),
    ("jaxops.models.pack_sequences", lambda: _models().pack_sequences([[1]], seq_len=0), IVE,
     ValueError),
    ("jaxops.models.pack_sequences", lambda: _models().pack_sequences([[1.5]], seq_len=4), ATE,
     TypeError),
    ("jaxops.models.plan.parse_mesh", lambda: _models_plan().parse_mesh("data=2"), IVE,
     ValueError),
    ("jaxops.models.post.preference_batch",
     lambda: _post().preference_batch([[1]], [[2.5]], [[3]], 8), ATE, TypeError),
    ("jaxops.models.post.preference_batch",
     lambda: _post().preference_batch([[1]], [[2]], [[]], 8), IVE, ValueError),
    ("jaxops.models.post.dpo_loss", lambda: _post().dpo_loss(*[np.zeros(2)] * 4, beta=-1), IVE,
     ValueError),
    ("jaxops.models.post.group_advantages", lambda: _post().group_advantages([1.0], 1), IVE,
     ValueError),
    ("jaxops.models.post.dpo_step", lambda: _post().dpo_step(_decoder(), None, loss_type="kto"),
     IVE, ValueError),
]  # fmt: skip


def _post():
    from jaxops.models import post

    return post


def _models_plan():
    from jaxops.models import plan

    return plan


@pytest.mark.parametrize(
    ("name", "call", "error", "builtin"),
    CASES,
    ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)],
)
def test_bad_arguments_raise_a_named_jaxops_error(name, call, error, builtin):
    with pytest.raises(Exception) as info:
        call()
    e = info.value
    assert isinstance(e, jaxops.JaxopsError), f"{type(e).__name__}: {e}"
    assert isinstance(e, error) and isinstance(e, builtin), f"{type(e).__mro__}: {e}"
    message = str(e)
    assert message.startswith(name + ": "), message
    # the public name once: no second "jaxops.<name>: " and no short prefix ("checkpoint: ")
    rest = message[len(name) + 2 :]
    assert not re.match(r"(jaxops(\.\w+)*|\w+): ", rest), message


def test_every_error_class_is_a_jaxops_error_and_its_builtin():
    assert issubclass(jaxops.InvalidArgumentError, ValueError)
    assert issubclass(jaxops.ArgumentTypeError, TypeError)
    assert issubclass(jaxops.ConfigError, jaxops.InvalidArgumentError)
    assert issubclass(ck.CheckpointError, RuntimeError)
    for cls in (jaxops.InvalidArgumentError, jaxops.ArgumentTypeError, jaxops.ConfigError,
                ck.CheckpointError, jaxops.JaxlibVersionError):  # fmt: skip
        assert issubclass(cls, jaxops.JaxopsError)
    assert set(jaxops.__all__) >= {"ArgumentTypeError", "InvalidArgumentError", "JaxopsError"}


def test_named_errors_names_by_the_outermost_public_call_once():
    @_errors.named_errors("jaxops.inner")
    def inner(kind):
        if kind == "plain":
            raise ValueError("x must be > 0, got -1")
        if kind == "type":
            raise TypeError("jaxops.inner: x must be an int, got str")
        if kind == "runtime":
            raise RuntimeError("not ours")
        raise ck.CheckpointError("jaxops.parallel.checkpoint.restore: no index.json")

    @_errors.named_errors("jaxops.outer")
    def outer(kind):
        return inner(kind)

    with pytest.raises(jaxops.InvalidArgumentError, match=r"^jaxops\.inner: x must be > 0"):
        inner("plain")
    with pytest.raises(jaxops.InvalidArgumentError, match=r"^jaxops\.outer: x must be > 0, got"):
        outer("plain")
    with pytest.raises(jaxops.ArgumentTypeError, match=r"^jaxops\.outer: x must be an int, got"):
        outer("type")
    with pytest.raises(ck.CheckpointError, match=r"^jaxops\.outer: no index\.json$"):
        outer("checkpoint")
    with pytest.raises(RuntimeError, match=r"^not ours$") as info:
        outer("runtime")
    assert not isinstance(info.value, jaxops.JaxopsError)

    # a user's own ValueError subclass passes as it is
    class Mine(ValueError):
        pass

    @_errors.named_errors("jaxops.calls_back")
    def calls_back(fn):
        return fn()

    with pytest.raises(Mine, match=r"^mine$"):
        calls_back(lambda: (_ for _ in ()).throw(Mine("mine")))
