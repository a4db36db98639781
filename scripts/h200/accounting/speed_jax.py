"""A short training-like JAX loop: an MLP, jax.jit of value_and_grad and an SGD update, on random
data made inside the step; block_until_ready every step. Prints one JSON line with steps/s over
--seconds after --warmup steps (the first includes compilation).

python3 speed_jax.py [--seconds 5] [--warmup 20] [--batch 2048] [--width 4096] [--depth 4]
"""

import argparse
import os
import time

import _common as C


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=4)
    a = p.parse_args()
    t0 = time.perf_counter()
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    keys = jax.random.split(key, a.depth + 1)
    params = [(jax.random.normal(k, (a.width, a.width), jnp.float32) / a.width ** 0.5,
               jnp.zeros((a.width,), jnp.float32)) for k in keys[:-1]]

    def loss(params, x, y):
        h = x
        for w, b in params[:-1]:
            h = jnp.tanh(h @ w + b)
        w, b = params[-1]
        return jnp.mean((h @ w + b - y) ** 2)

    @jax.jit
    def step(params, i):
        kx, ky = jax.random.split(jax.random.fold_in(keys[-1], i))
        x = jax.random.normal(kx, (a.batch, a.width), jnp.float32)
        y = jax.random.normal(ky, (a.batch, a.width), jnp.float32)
        l, g = jax.value_and_grad(loss)(params, x, y)
        return jax.tree_util.tree_map(lambda q, d: q - 1e-3 * d, params, g), l

    i = 0
    tc = time.perf_counter()
    for _ in range(a.warmup):
        params, l = step(params, i)
        l.block_until_ready()
        i += 1
    warm_s = time.perf_counter() - tc
    n, ts = 0, time.perf_counter()
    while time.perf_counter() - ts < a.seconds:
        params, l = step(params, i)
        l.block_until_ready()
        i += 1
        n += 1
    el = time.perf_counter() - ts
    try:
        ms = jax.devices()[0].memory_stats() or {}
        ms = {k: ms.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}
    except Exception as e:
        ms = C.error_info(e)
    C.emit({"prog": "speed_jax", "pid": os.getpid(), "steps": n, "seconds": round(el, 3),
            "steps_per_s": n / el, "warmup_s": round(warm_s, 3), "loss": float(l),
            "start_to_end_s": round(time.perf_counter() - t0, 2), "memory_stats": ms,
            "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "default(true)"),
            "under_vramd": bool(os.environ.get("VRAMD_SOCKET"))})


if __name__ == "__main__":
    main()
