#!/usr/bin/env python3
"""PyTorch on vramd, measured on one GPU: compatibility, allocation cost, training, tenants
(docs/benchmarks.md, the PyTorch sections). Writes results.json,
results.md and tenants.png (or .svg) under --out.

    python3 scripts/torch_on_vramd.py --out /tmp/torch_on_vramd [--bin .gpu/bin] [--runs 3]

It starts its own daemon (`vramd serve --backend cuda`, capped at --capacity) on a private
socket, and runs every workload as a child process: under `vramd run --torch-mode pool|full`,
and as plain PyTorch for comparison. Each check is recorded as pass/fail with its error; nothing
aborts the whole script. Binaries: --bin or VRAMD_BIN (vramd and libvram.so side by side).
"""

import argparse
import gc
import re
import signal
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.abspath(__file__)
MODES = ("pool", "full")
# The three-tenant scenario runs in vramd run's default mode (VRAMD_TENANT_MODE to change it).
TENANT_MODE = os.environ.get("VRAMD_TENANT_MODE", "full")
GIB = 2**30


# ---------------------------------------------------------------- workers (child processes)

def _torch():
    import torch

    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


def _check(results, name, fn):
    t = time.time()
    try:
        detail = fn()
        results[name] = {"ok": True, "detail": detail, "s": round(time.time() - t, 2)}
    except BaseException as e:  # a check never takes the others down
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                         "trace": traceback.format_exc()[-3000:]}


def worker_compat(args):
    torch = _torch()
    import vramd_torch

    dev = torch.device("cuda")
    r = {}
    lib_stats = vramd_torch.stats

    def mem_get_info():
        free, total = torch.cuda.mem_get_info()
        s = lib_stats()
        assert total == s["limit"], f"total {total} != limit {s['limit']}"
        # free is the daemon's budget for the tenant: its limit less everything counted against
        # it (held from vramd, plus memory it created itself and its context where the daemon
        # charges those), so at most the limit less what the allocator holds.
        held = s["stats"]["core"]["held"]
        assert free <= s["limit"] - held, (free, s)
        return {"free": free, "total": total, "counted_beyond_held": s["limit"] - held - free}

    def stats_functions():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        x = torch.empty(64 * 2**20, dtype=torch.uint8, device=dev)
        a = torch.cuda.memory_allocated()
        assert a - base >= 64 * 2**20, (base, a)
        assert torch.cuda.max_memory_allocated() >= a
        assert torch.cuda.memory_reserved() >= a
        st = torch.cuda.memory_stats()
        for k in ("allocated_bytes.all.current", "allocated_bytes.all.peak",
                  "reserved_bytes.all.current", "active_bytes.all.current",
                  "num_alloc_retries", "num_ooms"):
            assert k in st, f"memory_stats has no {k}"
        summary = torch.cuda.memory_summary()
        assert isinstance(summary, str) and summary
        del x
        torch.cuda.reset_peak_memory_stats()
        peak = torch.cuda.max_memory_allocated()
        assert peak < a, f"peak {peak} not reset below {a}"
        return {"allocated": a, "peak_after_reset": peak}

    def snapshot():
        x = torch.empty(32 * 2**20, dtype=torch.uint8, device=dev)
        snap = torch.cuda.memory._snapshot()
        blocks = [b for s in snap["segments"] for b in s["blocks"]]
        hit = [b for b in blocks if b["address"] == x.data_ptr()]
        assert hit and hit[0]["state"] == "active_allocated", "live tensor not in the snapshot"
        for s in snap["segments"]:
            assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
        del x
        return {"segments": len(snap["segments"]), "blocks": len(blocks)}

    def cuda_graph():
        static_in = torch.randn(1024, 1024, device=dev)
        w = torch.randn(1024, 1024, device=dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                (static_in @ w).relu().sum()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            tmp = (static_in @ w).relu()
            static_out = tmp * 2 + 1
        # Eager allocations after capture must not land on the graph's memory.
        noise = [torch.full((1024, 1024), 7.0, device=dev) for _ in range(8)]
        for i in range(3):
            static_in.copy_(torch.randn(1024, 1024, device=dev))
            g.replay()
            want = (static_in @ w).relu() * 2 + 1
            torch.cuda.synchronize()
            assert torch.allclose(static_out, want, rtol=1e-4, atol=1e-3), f"replay {i} wrong"
        assert all(bool((n == 7.0).all()) for n in noise), "a replay overwrote eager tensors"
        return "3 replays correct"

    def graphs_keep_their_memory():
        """Two graphs captured one after the other on one capture stream:
        the second's tensors must not lie in memory the first freed during its capture (the
        first's replays write it), and the graphs' memory comes back once they are released."""
        a = torch.randn(2**20, device=dev)  # 4 MiB: every tensor below is one block of 4 MiB
        size = a.numel() * a.element_size()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # pool mode: PyTorch's cached segments go back to vramd
        vramd_torch.trim()
        held0 = lib_stats()["stats"]["core"]["held"]
        pooled0 = lib_stats()["stats"]["core"]["pool_allocs"]
        kept0 = lib_stats()["stats"]["core"]["frees_in_capture"]
        side = torch.cuda.Stream()
        g1 = torch.cuda.CUDAGraph()
        freed = []
        with torch.cuda.graph(g1, stream=side):
            t = a * 2
            u = t + 1
            out1 = u * 3
            freed = [t.data_ptr(), u.data_ptr()]
            del t, u
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2, stream=side):
            outs = [a + i for i in range(8)]
        # Full mode: every allocation of the two captures went into a graph's private pool
        # (PyTorch announced the pools); pool mode: PyTorch's own allocator keeps its pools.
        pooled = lib_stats()["stats"]["core"]["pool_allocs"] - pooled0
        kept = lib_stats()["stats"]["core"]["frees_in_capture"] - kept0
        if vramd_torch.installed() == "full":
            assert pooled >= 11, f"{pooled} of the captures' 11 allocations went into a pool"
        shared = [i for i, o in enumerate(outs)
                  if any(p < o.data_ptr() + size and o.data_ptr() < p + size for p in freed)]
        g2.replay()
        g1.replay()
        torch.cuda.synchronize()
        assert not shared, (
            f"tensors {shared} of the second graph lie in memory the first freed during its "
            "capture")
        assert all(torch.equal(o, a + i) for i, o in enumerate(outs)), (
            "replaying the first graph overwrote the second's tensors")
        assert torch.equal(out1, (a * 2 + 1) * 3)
        during = lib_stats()["stats"]["core"]["held"]
        del g1, g2, out1, outs
        gc.collect()
        torch.cuda.empty_cache()
        vramd_torch.trim()
        after = lib_stats()["stats"]["core"]["held"]
        assert after <= held0 + 16 * 2**20, (
            f"held {after} after the graphs were released, {held0} before them")
        return {"pool_allocs": pooled, "frees_in_capture_outside_pools": kept,
                "held_during_mib": (during - held0) // 2**20,
                "held_after_mib": (after - held0) // 2**20}

    def compile_reduce_overhead():
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 512)).to(dev)
        f = torch.compile(model, mode="reduce-overhead")
        x = torch.randn(64, 512, device=dev)
        with torch.no_grad():
            for _ in range(4):
                y = f(x)
            ref = model(x)
        torch.cuda.synchronize()
        assert torch.allclose(y, ref, rtol=1e-3, atol=1e-3)
        return "compiled and replayed"

    def record_stream():
        side = torch.cuda.Stream()
        held0 = lib_stats()["stats"]["core"]["held"]
        for i in range(50):
            x = torch.full((4 * 2**20,), float(i), device=dev)
            with torch.cuda.stream(side):
                y = x * 2
            x.record_stream(side)
            y.record_stream(torch.cuda.current_stream())
            torch.cuda.current_stream().wait_stream(side)
            assert float(y[-1]) == 2.0 * i
            del x, y
        torch.cuda.synchronize()
        grown = lib_stats()["stats"]["core"]["held"] - held0
        # 50 iterations x 32 MiB; a working reuse stays far below that.
        assert grown < 20 * 16 * 2**20, f"held grew {grown / GIB:.2f} GiB: freed blocks not reused"
        return {"held_growth_mib": grown // 2**20}

    def backward_counted():
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to(dev)
        x = torch.randn(512, 2048, device=dev)
        torch.cuda.synchronize()
        before = lib_stats()["stats"]["core"]["allocs"]
        loss = model(x).square().mean()
        loss.backward()
        torch.cuda.synchronize()
        after = lib_stats()["stats"]["core"]["allocs"]
        free, total = torch.cuda.mem_get_info()
        # With vramd's counters: every backward allocation of the autograd threads is a vramd
        # allocation (full mode) or inside a vramd segment (pool mode: PyTorch's reserved memory
        # must all be held from vramd).
        s = lib_stats()["stats"]["core"]
        if vramd_torch.installed() == "pool":
            assert torch.cuda.memory_reserved() <= s["held"], (
                f"PyTorch reserves {torch.cuda.memory_reserved()} but vramd holds {s['held']}: "
                "some segments escaped the tenant")
        else:
            assert after > before, "backward made no allocation through vramd"
        return {"vramd_allocs_in_step": after - before, "held": s["held"]}

    def oom_is_catchable():
        limit = lib_stats()["limit"]
        try:
            torch.empty(limit + GIB, dtype=torch.uint8, device=dev)
        except torch.OutOfMemoryError as e:
            msg = str(e)
            s = lib_stats()
            assert s["tenant"] in msg, f"message does not name the tenant: {msg[:300]}"
            y = torch.ones(1024, device=dev)  # goes on
            return {"message": msg[:300], "after": float(y.sum())}
        raise AssertionError("no OutOfMemoryError past the limit")

    _check(r, "mem_get_info", mem_get_info)
    _check(r, "stats_functions", stats_functions)
    _check(r, "_snapshot", snapshot)
    _check(r, "cuda_graph", cuda_graph)
    _check(r, "graphs_keep_their_memory", graphs_keep_their_memory)
    _check(r, "compile_reduce_overhead", compile_reduce_overhead)
    _check(r, "record_stream_two_streams", record_stream)
    _check(r, "backward_counted", backward_counted)
    def oom_of_pytorchs_own():
        # PyTorch's own limit (its memory fraction) refuses before vramd would: its error, in
        # its words, not one blaming vramd.
        # The fraction is of the device's whole memory (its properties), not the tenant's limit:
        # 1 % of it, then 2 GiB, which the tenant's limit allows.
        torch.cuda.set_per_process_memory_fraction(0.01)
        try:
            torch.empty(2 * GIB, dtype=torch.uint8, device=dev)
        except torch.OutOfMemoryError as e:
            msg = str(e)
            assert "vramd" not in msg, f"PyTorch's own refusal blames vramd: {msg[:300]}"
            return {"message": msg[:300]}
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        raise AssertionError("no OutOfMemoryError past PyTorch's memory fraction")

    _check(r, "oom_catchable", oom_is_catchable)
    if vramd_torch.installed() == "pool":
        _check(r, "oom_of_pytorchs_own", oom_of_pytorchs_own)
    print("RESULT " + json.dumps(r), flush=True)


def _model(torch, name, dev, batch_size=None):
    bs = batch_size or (32 if name == "resnet50" else 16)
    if name == "resnet50":
        import torchvision

        m = torchvision.models.resnet50(weights=None, num_classes=1000)
        def batch(g):
            x = torch.randn(bs, 3, 224, 224, generator=g)
            y = torch.randint(0, 1000, (bs,), generator=g)
            return x, y
        def loss(m, x, y):
            return torch.nn.functional.cross_entropy(m(x), y)
    else:
        import transformers

        cfg = transformers.BertConfig()  # bert-base: 12 layers, 768 hidden
        m = transformers.BertForMaskedLM(cfg)
        def batch(g):
            ids = torch.randint(0, cfg.vocab_size, (bs, 128), generator=g)
            return ids, ids.clone()
        def loss(m, x, y):
            return m(input_ids=x, labels=y).loss
    return m.to(dev), batch, loss




def worker_allocbench(args):
    """Time per torch.empty + del pair on the GPU, for a size PyTorch's caching allocator and
    vramd's thread caches keep (32 KiB) and a larger one (4 MiB)."""
    torch = _torch()
    dev = torch.device("cuda")
    out = {}
    for size in (32 << 10, 4 << 20):
        for _ in range(2000):
            x = torch.empty(size, dtype=torch.uint8, device=dev)
            del x
        n = 20000
        t = time.perf_counter()
        for _ in range(n):
            x = torch.empty(size, dtype=torch.uint8, device=dev)
            del x
        out[f"ns_per_pair_{size >> 10}KiB"] = (time.perf_counter() - t) / n * 1e9
    print("RESULT " + json.dumps(out), flush=True)


def worker_generate(args):
    """GPT-2 medium (random weights) generating greedily for --steps requests of random batch
    (1-16), prompt (16-400 tokens) and length (16-128 new tokens), as the shared gpt2_generate
    trace did: its KV cache grows by one token a step (torch.cat per layer). A "loss" is the sum of
    a request's generated token ids, so runs can be compared token for token."""
    import random

    import transformers

    torch = _torch()
    torch.manual_seed(args.seed)
    dev = torch.device("cuda")
    cfg = transformers.GPT2Config(n_layer=24, n_embd=1024, n_head=16)
    m = transformers.GPT2LMHeadModel(cfg).to(dev).eval()
    rng = random.Random(args.seed)
    reqs = [(rng.randint(1, 16), rng.randint(16, 400), rng.randint(16, 128))
            for _ in range(args.steps)]
    g = torch.Generator().manual_seed(args.seed + 1)
    vramd_stats = _vramd_stats()
    stats_at = {}
    losses, times, gpu_ms, cpu_s = [], [], [], []
    with torch.no_grad():
        for i, (batch, prompt, new) in enumerate(reqs):
            if i == args.warmup:
                stats_at["warm"] = vramd_stats()
            ids = torch.randint(0, cfg.vocab_size, (batch, prompt), generator=g).to(dev)
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            c = time.process_time()
            t = time.perf_counter()
            begin.record()
            out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
            end.record()
            losses.append(int(out[:, prompt:].sum().item()))
            times.append(time.perf_counter() - t)
            cpu_s.append(time.process_time() - c)
            gpu_ms.append(begin.elapsed_time(end))
    res = {"losses": losses, "times": times, "gpu_ms": gpu_ms, "cpu_s": cpu_s,
           "peak_reserved": torch.cuda.max_memory_reserved(),
           "peak_allocated": torch.cuda.max_memory_allocated(), "requests": reqs}
    end_stats = vramd_stats()
    if end_stats is not None:
        res["vramd_held_peak"] = end_stats["core"]["held_peak"]
        res["vramd_requested_peak"] = end_stats["core"]["requested_peak"]
        res["vramd_per_step"] = _per_step(stats_at.get("warm"), end_stats,
                                          max(1, args.steps - args.warmup))
    print("RESULT " + json.dumps(res), flush=True)


def _per_step(a, b, n):
    """What the allocator did per timed step between the statistics `a` and `b`: allocations
    and frees, driver calls, allocations served from the thread caches."""
    if a is None or b is None:
        return None
    return {
        **{k: (b["core"][k] - a["core"][k]) / n
           for k in ("allocs", "frees", "grants", "maps", "unmaps", "returns", "fences",
                     "fence_queries") if k in b["core"]},
        "fast_allocs": (b["fast_allocs"] - a["fast_allocs"]) / n,
        **{k: (b[k] - a[k]) / n for k in ("core_ops", "core_ns") if k in b},
    }


def worker_train(args):
    if args.model == "gpt2gen":
        return worker_generate(args)
    torch = _torch()
    torch.manual_seed(args.seed)
    if args.deterministic:
        # Kernels whose results do not depend on timing (atomics), so that runs at batch sizes
        # where PyTorch's defaults differ from run to run can still be compared loss for loss.
        torch.use_deterministic_algorithms(True)
    dev = torch.device("cuda")
    m, batch, loss_fn = _model(torch, args.model, dev, args.batch)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(args.seed + 1)
    data = [batch(g) for _ in range(args.steps)]
    vramd_stats = _vramd_stats()
    stats_at = {}
    losses, times, gpu_ms, cpu_s = [], [], [], []
    for i, (x, y) in enumerate(data):
        if i == args.warmup:
            stats_at["warm"] = vramd_stats()
        x, y = x.to(dev), y.to(dev)
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c = time.process_time()
        t = time.perf_counter()
        begin.record()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(m, x, y)
        loss.backward()
        opt.step()
        end.record()
        losses.append(loss.item())
        times.append(time.perf_counter() - t)
        # Process CPU time (every thread, autograd's included) and the GPU's time for the step:
        # which of the two a slower allocator route lengthens.
        cpu_s.append(time.process_time() - c)
        gpu_ms.append(begin.elapsed_time(end))
    stats_at["end"] = vramd_stats()
    out = {"losses": losses, "times": times, "gpu_ms": gpu_ms, "cpu_s": cpu_s,
           "peak_reserved": torch.cuda.max_memory_reserved()}
    if stats_at["end"] is not None:
        out["vramd_held_peak"] = stats_at["end"]["core"]["held_peak"]
        # What the allocator did per timed step, after warm-up: fences recorded and queried,
        # grants and maps (driver calls), allocations served from the thread caches.
        per_step = _per_step(stats_at.get("warm"), stats_at["end"],
                             max(1, args.steps - args.warmup))
        if per_step is not None:
            out["vramd_per_step"] = per_step
    print("RESULT " + json.dumps(out), flush=True)


def _vramd_stats():
    """A function giving vramd's allocator statistics under vramd, None otherwise."""
    try:
        import vramd_torch

        if vramd_torch.installed():
            return lambda: vramd_torch.stats()["stats"]
    except ImportError:
        pass
    return lambda: None


# Borrower-a's size at which borrower-b starts (see `tenants`).
MARK_AT_GIB = 20


def worker_tenant(args):
    """trainer: keeps a base, needs `--step-gib` more each step. borrower: grows by 1 GiB chunks
    until refused, holds, and exits after --life seconds. Reports held memory over time."""
    torch = _torch()
    dev = torch.device("cuda")
    t0 = args.t0
    events = []

    def held():
        try:
            import vramd_torch

            if vramd_torch.installed():
                return vramd_torch.stats()["stats"]["core"]["held"]
        except ImportError:
            pass
        return torch.cuda.memory_reserved()

    def note(kind, **kw):
        events.append({"t": round(time.time() - t0, 3), "kind": kind, "held": held(), **kw})

    chunks, ooms = [], 0
    if args.after:
        # Start once another tenant says so (it was refused), or after half this one's life.
        give_up = time.time() + args.life / 2
        while not os.path.exists(args.after) and time.time() < give_up:
            time.sleep(0.05)
    end = time.time() + args.life
    if args.role == "trainer":
        base = torch.empty(int(args.base_gib * GIB), dtype=torch.uint8, device=dev)
        while time.time() < end:
            try:
                tmp = torch.empty(int(args.step_gib * GIB), dtype=torch.uint8, device=dev)
                tmp.fill_(1)
                torch.cuda.synchronize()
                del tmp
                note("step")
            except torch.OutOfMemoryError as e:
                ooms += 1
                note("oom", error=str(e)[:300])
            time.sleep(0.1)
        del base
    else:
        while time.time() < end:
            try:
                chunks.append(torch.empty(GIB, dtype=torch.uint8, device=dev))
                note("grow", chunks=len(chunks))
                if args.mark and len(chunks) == MARK_AT_GIB:
                    open(args.mark, "w").close()
            except torch.OutOfMemoryError as e:
                ooms += 1
                note("oom", chunks=len(chunks), error=str(e)[:300])
                if args.mark and ooms == 1:
                    open(args.mark, "w").close()  # refused before MARK_AT_GIB
                torch.cuda.empty_cache()
                time.sleep(0.3)
            time.sleep(0.05)
    print("RESULT " + json.dumps({"role": args.role, "ooms": ooms, "events": events}), flush=True)


# ---------------------------------------------------------------- driver

class Run:
    def __init__(self, opts):
        self.o = opts
        self.bin = os.path.abspath(opts.bin)
        self.vramd = os.path.join(self.bin, "vramd")
        self.socket = os.path.join(opts.out, "vramd.sock")
        self.daemon = None
        self.results = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def start_daemon(self):
        cfg = os.path.join(self.o.out, "vramd.toml")
        with open(cfg, "w") as f:
            # `train` ranks above the default class: this user may ask for it.
            f.write(f'capacity = "{self.o.capacity}"\nreclaim_timeout_ms = 250\n'
                    f'[classes.train]\npriority = 100\nusers = [{os.getuid()}]\n'
                    '[classes.borrow]\npriority = 1\n')
        log = open(os.path.join(self.o.out, "vramd.log"), "w")
        self.daemon = subprocess.Popen(
            [self.vramd, "serve", "--backend", "cuda", "--socket", self.socket, "--config", cfg],
            stdout=log, stderr=log)
        for _ in range(300):
            if os.path.exists(self.socket):
                r = subprocess.run([self.vramd, "status", "--socket", self.socket],
                                   capture_output=True, text=True)
                if r.returncode == 0:
                    self.results["daemon_status_at_start"] = r.stdout
                    return
            if self.daemon.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError("the daemon did not come up; see vramd.log")

    def stop_daemon(self):
        if self.daemon and self.daemon.poll() is None:
            self.daemon.terminate()
            try:
                self.daemon.wait(15)
            except subprocess.TimeoutExpired:
                self.daemon.kill()

    def cmd(self, mode, worker_args, tenant=None, flags=()):
        mode = mode.split(":")[0]
        if tenant:
            tenant = re.sub(r"[^A-Za-z0-9_.@-]", "_", tenant)
        py = [sys.executable, HERE, "--worker"] + worker_args
        if mode == "plain" or mode == "expandable":
            return py
        c = [self.vramd, "run", "--socket", self.socket, "--torch-mode", mode]
        if tenant:
            c += ["--tenant", tenant]
        return c + list(flags) + ["--"] + py

    def child(self, mode, worker_args, timeout=300, **kw):
        env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if mode == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        # A mode may carry settings: "full:VRAMD_ALLOC=seal_every=1".
        for setting in mode.split(":")[1:]:
            k, _, v = setting.partition("=")
            env[k] = v
        c = self.cmd(mode, worker_args, **kw)
        pin = None
        if self.o.cpus:
            # Every run on the same cores: on a VM, where a CPU-bound run lands moves its speed.
            pin = lambda: os.sched_setaffinity(0, self.o.cpus)
        r = subprocess.run(c, capture_output=True, text=True, timeout=timeout, env=env,
                           preexec_fn=pin)
        for line in r.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:]), r
        raise RuntimeError(f"exit {r.returncode}: {r.stderr[-2000:]}")

    def compat(self):
        out = {}
        for mode in MODES:
            try:
                res, r = self.child(mode, ["compat"], tenant=f"compat-{mode}",
                                    flags=["--limit", "16GiB"], timeout=400)
                out[mode] = res
                out[mode + "_stderr"] = r.stderr[-3000:]
            except BaseException as e:
                out[mode] = {"_run": {"ok": False, "error": str(e)[:2000]}}
        self.results["compat"] = out

    def save(self):
        """Writes results.json and results.md with what has been measured so far."""
        with open(os.path.join(self.o.out, "results.json"), "w") as f:
            json.dump(self.results, f, indent=1)
        with open(os.path.join(self.o.out, "results.md"), "w") as f:
            f.write(markdown(self.results))

    def allocbench(self):
        out = {}
        for mode in ["plain"] + self.o.train_modes:
            try:
                res, _ = self.child(mode, ["allocbench"], tenant=f"allocbench-{mode}",
                                    flags=["--limit", "16GiB"])
            except BaseException as e:
                res = {"error": str(e)[-1500:]}
            out[mode] = res
        self.results["allocbench"] = out

    def training(self):
        out = {}
        for model in self.o.models:
            per = {}
            wa = ["train", "--model", model, "--steps", str(self.o.steps), "--seed", "1234",
                  "--warmup", str(self.o.warmup)]
            if self.o.batch:
                wa += ["--batch", str(self.o.batch)]
            if self.o.deterministic:
                wa += ["--deterministic"]
            # Interleaved rounds (each allocator once per round), so that a drift of the machine
            # over the minutes of the runs does not favour one allocator; the order turns by one
            # each round, so that none always runs first or last (on a VM the place in the order
            # alone can move an allocator's speed by more than the differences to be measured).
            for i in range(self.o.runs):
                order = ["plain"] + (["expandable"] if i == 0 else []) + self.o.train_modes
                k = i % len(order)
                for mode in order[k:] + order[:k]:
                    try:
                        res, _ = self.child(mode, wa, tenant=f"{model}-{mode}-{i}",
                                            flags=["--limit", "64GiB"])
                    except BaseException as e:
                        res = {"error": str(e)[:2000]}
                    per.setdefault(mode, []).append(res)
                # After every round, so that a run cut short keeps the rounds it finished.
                out[model] = summarize_training(per, self.o.warmup)
                self.results["training"] = out
                self.save()
        self.results["training"] = out

    def tenants(self, mode):
        """Trainer (guarantee) and two borrowers whose limits together exceed what is left."""
        t0 = time.time() + 2
        life = self.o.tenant_seconds
        full_marker = os.path.join(os.path.abspath(self.o.out), f"borrower-a-refused-{mode}")
        if os.path.exists(full_marker):
            os.remove(full_marker)
        common = ["--t0", str(t0)]
        specs = [
            ("trainer", ["tenant", "--role", "trainer", "--base-gib", "12", "--step-gib", "4",
                         "--life", str(life)] + common,
             ["--class", "train", "--guarantee", "20GiB", "--limit", "24GiB"]),
            ("borrower-a", ["tenant", "--role", "borrower", "--life", str(life * 0.4),
                            "--mark", full_marker] + common,
             ["--class", "borrow", "--limit", "24GiB"]),
            # Borrower-b starts growing once borrower-a holds MARK_AT_GIB or was refused (or
            # after half b's life), so that the order is the same in every run: a takes most
            # of what is left, b is refused at the remainder, and once a exits (its life is
            # shorter) b grows into what a gave back.
            ("borrower-b", ["tenant", "--role", "borrower", "--life", str(life),
                            "--after", full_marker] + common,
             ["--class", "borrow", "--limit", "24GiB"]),
        ]
        procs = []
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        for name, wa, flags in specs:
            c = self.cmd(mode if mode != "plain" else "plain", wa, tenant=name, flags=flags)
            procs.append((name, subprocess.Popen(c, stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE, text=True, env=env)))
        out = {}
        for name, p in procs:
            try:
                so, se = p.communicate(timeout=life + 120)
            except subprocess.TimeoutExpired:
                p.kill()
                so, se = p.communicate()
            res = None
            for line in so.splitlines():
                if line.startswith("RESULT "):
                    res = json.loads(line[7:])
            out[name] = {"exit": p.returncode, "result": res, "stderr": se[-1500:]}
        return out

    def three_tenants(self):
        out = {}
        for mode in [TENANT_MODE, "plain"]:
            try:
                out[mode] = self.tenants(mode)
            except BaseException as e:
                out[mode] = {"error": str(e)[:2000]}
        self.results["three_tenants"] = out
        try:
            self.results["plot"] = plot(out, self.o.out)
        except BaseException as e:
            self.results["plot"] = f"failed: {e}"


def steps_per_s(run, warmup):
    """A training run's speed: its timed steps (those after `warmup`) over their total time."""
    t = run["times"][warmup:]
    return len(t) / sum(t) if t else None


def summarize_training(per, warmup):
    def thr(r):
        return steps_per_s(r, warmup)

    def thr_typical(r):
        # Steps per second at the median step time: a stall of the machine in one step (the VM's
        # CPU is shared) moves the mean, not this.
        t = r["times"][warmup:]
        return 1 / statistics.median(t) if t else None

    ok = {m: [r for r in rs if "losses" in r] for m, rs in per.items()}
    summary = {"runs": per, "modes": {}}
    ref = ok.get("plain") or []
    base_thr = statistics.median([thr(r) for r in ref]) if ref else None
    for mode, rs in ok.items():
        if not rs:
            summary["modes"][mode] = {"error": [r.get("error") for r in per[mode]]}
            continue
        med = statistics.median([thr(r) for r in rs])
        same = bool(ref) and all(r["losses"] == ref[0]["losses"] for r in rs)
        first_diff = None
        if ref and not same:
            for r in rs:
                for i, (a, b) in enumerate(zip(r["losses"], ref[0]["losses"])):
                    if a != b:
                        first_diff = {"step": i, "this": a, "plain": b}
                        break
                if first_diff:
                    break
        peak = max(r.get("vramd_held_peak", r["peak_reserved"]) for r in rs)
        # Runs are interleaved in rounds: the ratio to the same round's plain run cancels a drift
        # of the machine's speed between rounds (CPU-bound models such as BERT-base feel it).
        runs = per.get(mode, [])
        paired = [thr(a) / thr(b) for a, b in zip(runs, per.get("plain", []))
                  if "times" in a and "times" in b]
        paired_typical = [thr_typical(a) / thr_typical(b)
                          for a, b in zip(runs, per.get("plain", []))
                          if "times" in a and "times" in b]
        summary["modes"][mode] = {
            "steps_per_s_median": med,
            "throughput_ratio": (med / base_thr) if base_thr else None,
            "throughput_ratio_paired_median": statistics.median(paired) if paired else None,
            "throughput_ratio_paired_each_round": paired,
            "median_step_ratio_paired_median": (statistics.median(paired_typical)
                                                if paired_typical else None),
            "losses_identical_to_plain": same,
            "first_loss_difference": first_diff,
            "peak_device_bytes": peak,
            "peak_reserved_by_torch": max(r["peak_reserved"] for r in rs),
            "step_ms_median": _median_over(rs, "times", warmup, 1e3),
            # Each run's fastest tenth of steps: what the step costs when nothing else on the VM
            # got in the way (a diagnostic beside the medians, not the throughput figure).
            "step_ms_p10_median": _median_of_runs(rs, warmup, lambda t: _quantile(t, 0.1) * 1e3),
            "gpu_ms_median": _median_over(rs, "gpu_ms", warmup, 1.0),
            "cpu_ms_median": _median_over(rs, "cpu_s", warmup, 1e3),
            "vramd_per_step": next((r["vramd_per_step"] for r in rs if "vramd_per_step" in r),
                                   None),
        }
    return summary


def _median_of_runs(runs, warmup, stat):
    """The median over runs of `stat` of each run's step times after warm-up."""
    xs = [stat(r["times"][warmup:]) for r in runs if r["times"][warmup:]]
    return statistics.median(xs) if xs else None


def _quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _median_over(runs, key, warmup, scale):
    """The median, over every run's steps after warm-up, of `key`, times `scale`."""
    xs = [x * scale for r in runs for x in r.get(key, [])[warmup:]]
    return statistics.median(xs) if xs else None


def plot(three, outdir):
    series = {}
    for mode, tenants in three.items():
        if not isinstance(tenants, dict) or "error" in tenants:
            continue
        for name, t in tenants.items():
            ev = (t.get("result") or {}).get("events") or []
            series[(mode, name)] = ([e["t"] for e in ev], [e["held"] / GIB for e in ev],
                                    [e["t"] for e in ev if e["kind"] == "oom"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        modes = sorted({m for m, _ in series})
        fig, axes = plt.subplots(len(modes), 1, figsize=(9, 3.5 * len(modes)), squeeze=False)
        for ax, mode in zip(axes[:, 0], modes):
            for (m, name), (ts, hs, ooms) in sorted(series.items()):
                if m != mode:
                    continue
                line, = ax.step(ts, hs, where="post", label=name)
                ax.plot(ooms, [0] * len(ooms), "x", color=line.get_color())
            ax.set_title(f"under vramd ({mode} mode)" if mode != "plain" else "plain PyTorch")
            ax.set_xlabel("s")
            ax.set_ylabel("held (GiB); x = OOM")
            ax.legend()
        fig.tight_layout()
        path = os.path.join(outdir, "tenants.png")
        fig.savefig(path, dpi=110)
        return path
    except ImportError:
        return svg(series, outdir)


def svg(series, outdir):
    w, h, pad = 900, 300, 40
    tmax = max([max(ts) for ts, _, _ in series.values() if ts] + [1])
    hmax = max([max(hs) for _, hs, _ in series.values() if hs] + [1])
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{2 * h}">']
    for row, mode in enumerate([TENANT_MODE, "plain"]):
        y0 = row * h
        parts.append(f'<text x="{pad}" y="{y0 + 20}">{mode}: held GiB over time</text>')
        for i, ((m, name), (ts, hs, _)) in enumerate(sorted(series.items())):
            if m != mode or not ts:
                continue
            pts = " ".join(f"{pad + t / tmax * (w - 2 * pad):.1f},"
                           f"{y0 + h - pad - v / hmax * (h - 2 * pad):.1f}" for t, v in zip(ts, hs))
            c = colors[i % len(colors)]
            parts.append(f'<polyline fill="none" stroke="{c}" points="{pts}"/>')
            parts.append(f'<text x="{w - 200}" y="{y0 + 40 + 15 * (i % 3)}" fill="{c}">{name}</text>')
    parts.append("</svg>")
    path = os.path.join(outdir, "tenants.svg")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return path


def markdown(res):
    L = ["# PyTorch on vramd", "", f"Run {res.get('started')}.", ""]
    ts = res.get("training_settings")
    if ts:
        L += [f"Training: batch {ts['batch'] or 'default'}, {ts['steps']} steps of which the "
              f"first {ts['warmup']} are not timed"
              + (", deterministic algorithms" if ts.get("deterministic") else "") + ".", ""]
    compat = res.get("compat", {})
    if compat:
        L += ["## Compatibility", "", "| check | " + " | ".join(MODES) + " |",
              "|---|" + "---|" * len(MODES)]
        names = sorted({k for m in MODES for k in (compat.get(m) or {})})
        for n in names:
            cells = []
            for m in MODES:
                c = (compat.get(m) or {}).get(n)
                cells.append("—" if c is None else ("pass" if c["ok"] else
                             "FAIL: " + c["error"].replace("|", "/").replace("\n", " ")[:120]))
            L.append(f"| {n} | " + " | ".join(cells) + " |")
        L.append("")
    if res.get("allocbench"):
        L += ["## Allocation cost (torch.empty + del, ns per pair)", "",
              "| allocator | 32 KiB | 4 MiB |", "|---|---|---|"]
        for mode, v in res["allocbench"].items():
            if "error" in v:
                L.append(f"| {mode} | error: {v['error'][-200:]!r} | |")
            else:
                L.append(f"| {mode} | {v['ns_per_pair_32KiB']:.0f} | {v['ns_per_pair_4096KiB']:.0f} |")
        L.append("")
    for model, s in (res.get("training") or {}).items():
        L += [f"## {model} training", "",
              "| allocator | steps/s (median) | ratio to plain | ratio to plain, paired by round "
              "(median) | same, at the median step time | losses identical | peak device memory |",
              "|---|---|---|---|---|---|---|"]
        for mode, v in s["modes"].items():
            if "error" in v:
                L.append(f"| {mode} | error: {str(v['error'])[:150]} | | | | | |")
                continue
            ratio, paired = v["throughput_ratio"], v.get("throughput_ratio_paired_median")
            typical = v.get("median_step_ratio_paired_median")
            L.append(f"| {mode} | {v['steps_per_s_median']:.2f} | "
                     f"{'' if ratio is None else f'{ratio:.3f}'} | "
                     f"{'' if paired is None else f'{paired:.3f}'} | "
                     f"{'' if typical is None else f'{typical:.3f}'} | "
                     f"{v['losses_identical_to_plain']} | {v['peak_device_bytes']:,} B "
                     f"({v['peak_device_bytes'] / GIB:.2f} GiB) |")
        L += ["", "Where a step's time goes (medians over every timed step of every run; CPU is "
              "the process's, every thread; vramd's counts are per timed step):", "",
              "| allocator | step ms | step ms, 10th percentile | GPU ms | CPU ms | allocs in the core "
              "| from thread caches | fences recorded | fence queries | grants | maps | unmaps |",
              "|---|" + "---|" * 11]
        for mode, v in s["modes"].items():
            if "error" in v:
                continue
            f = lambda x: "" if x is None else f"{x:.2f}"
            c = v.get("vramd_per_step") or {}
            L.append(f"| {mode} | {f(v.get('step_ms_median'))} | {f(v.get('step_ms_p10_median'))} | "
                     f"{f(v.get('gpu_ms_median'))} | "
                     f"{f(v.get('cpu_ms_median'))} | " + " | ".join(
                         f(c.get(k)) for k in ("allocs", "fast_allocs", "fences", "fence_queries",
                                               "grants", "maps", "unmaps")) + " |")
        L.append("")
    three = res.get("three_tenants") or {}
    if three:
        L += ["## Three tenants", "", "| run | tenant | exit | OOMs caught | peak held |",
              "|---|---|---|---|---|"]
        for mode, tenants in three.items():
            if "error" in tenants:
                L.append(f"| {mode} | error: {tenants['error'][:150]} | | | |")
                continue
            for name, t in tenants.items():
                r = t.get("result") or {}
                ev = r.get("events") or []
                peak = max([e["held"] for e in ev] + [0]) / GIB
                L.append(f"| {mode} | {name} | {t['exit']} | {r.get('ooms', '?')} | {peak:.1f} GiB |")
        L += ["", f"Plot: {os.path.basename(str(res.get('plot')))}", ""]
    return "\n".join(L)


def _cpu_list(text):
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", nargs=argparse.REMAINDER)
    p.add_argument("--out", default="torch_on_vramd_results")
    p.add_argument("--bin", default=os.environ.get("VRAMD_BIN", ".gpu/bin"))
    p.add_argument("--capacity", default="60 GiB", help="what the test daemon serves")
    p.add_argument("--runs", type=int, default=2, help="runs per allocator, for the medians")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, help="batch size (default: 32 for resnet50, 16 for bert)")
    p.add_argument("--cpus", type=_cpu_list, help="run every worker on these CPUs, e.g. 1-8")
    p.add_argument("--deterministic", action="store_true",
                   help="train with torch.use_deterministic_algorithms(True): needed for identical "
                        "losses at batch sizes where PyTorch's default kernels are not (BERT at 32)")
    p.add_argument("--models", nargs="+", default=["resnet50", "bert"])
    p.add_argument("--train-modes", nargs="+", default=list(MODES),
                   help="vramd modes to train under, each optionally with settings for the "
                        "tenant's environment, e.g. full:VRAMD_ALLOC=seal_every=1")
    p.add_argument("--tenant-seconds", type=float, default=12)
    p.add_argument("--skip", nargs="*", default=[], choices=["compat", "allocbench", "training", "tenants"])
    o = p.parse_args()
    if o.worker:
        w = argparse.ArgumentParser()
        w.add_argument("kind")
        w.add_argument("--model")
        w.add_argument("--steps", type=int)
        w.add_argument("--seed", type=int)
        w.add_argument("--batch", type=int)
        w.add_argument("--deterministic", action="store_true")
        w.add_argument("--warmup", type=int, default=0)
        w.add_argument("--role")
        w.add_argument("--base-gib", type=float, default=0)
        w.add_argument("--step-gib", type=float, default=0)
        w.add_argument("--life", type=float, default=10)
        w.add_argument("--t0", type=float, default=0)
        w.add_argument("--mark", help="a file to create at MARK_AT_GIB held or the first refusal")
        w.add_argument("--after", help="start growing once this file exists")
        a = w.parse_args(o.worker)
        {"compat": worker_compat, "train": worker_train, "tenant": worker_tenant,
         "allocbench": worker_allocbench}[a.kind](a)
        return
    os.makedirs(o.out, exist_ok=True)
    run = Run(o)
    if o.cpus:
        run.results["worker_cpus"] = sorted(o.cpus)
    run.results["training_settings"] = {"batch": o.batch, "steps": o.steps, "warmup": o.warmup,
                                        "deterministic": o.deterministic}
    start = time.time()

    def stop(signum, frame):
        # `timeout` and the like: end like Ctrl-C, keeping what was measured.
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    try:
        run.start_daemon()
        for part, fn in [("compat", run.compat), ("allocbench", run.allocbench),
                         ("training", run.training), ("tenants", run.three_tenants)]:
            if part in o.skip:
                continue
            t = time.time()
            try:
                fn()
            except BaseException as e:
                run.results[part + "_error"] = traceback.format_exc()[-3000:]
                if isinstance(e, KeyboardInterrupt):
                    break
            run.results.setdefault("seconds", {})[part] = round(time.time() - t, 1)
            run.save()
    except BaseException:
        run.results["error"] = traceback.format_exc()[-3000:]
    finally:
        run.stop_daemon()
        run.results["total_seconds"] = round(time.time() - start, 1)
        run.save()
    print(markdown(run.results))


if __name__ == "__main__":
    main()
