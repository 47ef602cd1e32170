"""Demo: RMSNorm through the jaxops custom call, under jit, on 8 simulated CPU devices.

Shards a batch of activations over a (data=4, model=2) mesh, runs ``jaxops.rms_norm`` and
``jaxops.add_rms_norm`` forward and backward, and prints what ran: the custom call targets in the
compiled program, the collectives XLA inserted, the error against the pure-JAX twin and timings.

Run: python examples/demo_rms_norm.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxops
from jaxops.testing import count_collectives


def timed(fn, *args, repeats=5):
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    jax.config.update("jax_num_cpu_devices", 8)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    print(
        f"jax {jax.__version__} on {len(jax.devices())} {jax.default_backend()} devices, "
        f"mesh {dict(mesh.shape)}; jaxops build: {jaxops.build_info()}"
    )

    batch, seq, hidden = 32, 128, 1024
    key_x, key_r, key_w = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key_x, (batch, seq, hidden), jnp.bfloat16)
    residual = jax.random.normal(key_r, (batch, seq, hidden), jnp.bfloat16)
    weight = 1.0 + 0.1 * jax.random.normal(key_w, (hidden,), jnp.float32)

    def block(x, residual, weight, impl=None):
        y, h = jaxops.add_rms_norm(x, residual, weight, impl=impl)
        return jaxops.rms_norm(y * 2, weight, impl=impl), h

    def loss(x, residual, weight, impl=None):
        y, h = block(x, residual, weight, impl)
        return jnp.mean(y.astype(jnp.float32) ** 2) + jnp.mean(h.astype(jnp.float32))

    for name, spec in [
        ("batch sharded", P("data", "model", None)),
        ("hidden sharded", P("data", None, "model")),
    ]:
        with jax.set_mesh(mesh):
            xs = jax.device_put(x, NamedSharding(mesh, spec))
            rs = jax.device_put(residual, NamedSharding(mesh, spec))
            ws = jax.device_put(weight, NamedSharding(mesh, P(spec[2])))
            fwd = jax.jit(block)
            grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            fwd_hlo = fwd.lower(xs, rs, ws).compile().as_text()
            grad_hlo = grad.lower(xs, rs, ws).compile().as_text()
            targets = sorted(
                {
                    t
                    for t in (
                        "jaxops_rms_norm_fwd",
                        "jaxops_add_rms_norm_fwd",
                        "jaxops_rms_norm_bwd",
                    )
                    if t in fwd_hlo + grad_hlo
                }
            )
            y, h = fwd(xs, rs, ws)
            grads = grad(xs, rs, ws)
            t_fwd, t_grad = timed(fwd, xs, rs, ws), timed(grad, xs, rs, ws)
        y_ref, h_ref = block(x, residual, weight, impl="xla")
        grads_ref = jax.grad(loss, argnums=(0, 1, 2))(x, residual, weight, "xla")
        y32, y_ref32 = y.astype(jnp.float32), y_ref.astype(jnp.float32)
        err = float(jnp.max(jnp.abs(y32 - y_ref32) / jnp.maximum(jnp.abs(y_ref32), 1.0)))
        gerr = max(
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            for a, b in zip(grads, grads_ref, strict=True)
        )
        print(f"\n[{name}] x {x.shape} {x.dtype} with sharding {spec}")
        print(f"  custom calls in the compiled program: {', '.join(targets)}")
        print(
            f"  collectives: forward {count_collectives(fwd_hlo) or 'none'}, "
            f"forward+backward {count_collectives(grad_hlo) or 'none'}"
        )
        print(
            f"  output sharding {y.sharding.spec}; h == twin: "
            f"{bool(np.array_equal(np.asarray(h), np.asarray(h_ref)))}"
        )
        print(
            f"  max relative |y - twin| = {err:.3g} (one bf16 ulp: {2**-7:.3g}), "
            f"max |grad - twin grad| = {gerr:.3g}"
        )
        print(f"  time: forward {t_fwd:.2f} ms, forward+backward {t_grad:.2f} ms")


if __name__ == "__main__":
    main()
