#!/usr/bin/env python3
"""A one-node Ray cluster over a vramd daemon, with real PyTorch on the GPU (run by ray_gpu.sh).

Starts a Ray head (`ray start --head --block` in a session of its own, with the daemon's
`vramd ray-resources` figure as its `--resources`), connects to it, and checks with actors and
tasks that ask for memory through `vramd.ray`:

- two `@ray.remote(**vramd.ray.options(memory="4GiB", limit="6GiB"))` actors and a plain
  `@ray.remote` actor given `.options(**vramd.ray.options(...))`, each holding a 2 GiB tensor: the
  daemon lists each as a tenant with that guarantee and limit and its memory; vramd's allocator
  is installed in full mode in each and `torch.cuda.mem_get_info()` answers with the limit;
- an actor past its limit gets `torch.OutOfMemoryError` naming its tenant; the others' tensors
  are intact and they still allocate, and so does the refused one;
- `ray.kill` of one actor and SIGKILL of another's worker: the time until the daemon no longer
  lists its tenant and no longer holds its memory (polled every 5 ms);
- a task run 5 times in a row on a reused worker: 5 tenants, each starting with nothing held;
- 50 AdamW steps of a TransformerEncoderLayer in an actor;
- at the end the daemon holds nothing and lists no tenant.

Prints `ok: ...` per check and `measured: ...` figures; any failed check raises (non-zero exit).
`--no-torch` makes the same checks with vramd's own client allocations in place of tensors (for a
machine without a GPU or torch: a host-backend daemon).

    PYTHONPATH=/tmp/raysite:/tmp/vramd-py PATH=.gpu/bin:$PATH \
      python3 scripts/h200/ray_gpu.py --socket S --resources '{"vramd_memory_mib": N}' [--logs DIR]
"""

import argparse
import ctypes
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import vramd
import vramd.ray as vr

# The helpers the Ray checks share, beside the CI's Ray test.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "crates", "vramd", "tests", "ray"))
from cluster import free_port, held, pids_in_sessions, tenants, wait_for  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
T0 = time.time()
# Set by main() before anything is sent to a worker (cloudpickle carries these globals along).
TORCH = True
TOUCH = 64 * MiB  # without torch: the bytes of each block written and checked


def say(kind, msg):
    print(f"{kind}: {msg} [{time.time() - T0:.1f} s]", flush=True)


# ---- what runs in the workers: a block of device memory, with torch or vramd's client --------


def alloc(nbytes, fill):
    """A block of `nbytes` filled with `fill` (torch: an int32 tensor on cuda)."""
    if TORCH:
        import torch

        return torch.full((nbytes // 4,), fill, dtype=torch.int32, device="cuda")
    t = vramd.current()
    p = t.alloc(nbytes)
    ctypes.memset(p, fill, min(nbytes, TOUCH))
    return (p, nbytes, fill)


def intact(block, fill):
    if TORCH:
        import torch

        torch.cuda.synchronize()
        # A comparison's temporary is a byte per element, inside the actor's limit.
        return bool((block == fill).all())
    p, nbytes, _ = block
    n = min(nbytes, TOUCH)
    return ctypes.string_at(p, n).count(bytes([fill])) == n


def release(block):
    if not TORCH:
        vramd.current().free(block[0])


def refusal_type():
    if TORCH:
        import torch

        return torch.OutOfMemoryError
    return vramd.VramdError


def worker_view():
    """What the tenant looks like from inside its worker."""
    t = vramd.current()
    s = t.stats()
    out = {
        "pid": os.getpid(),
        "name": s["tenant"],
        "guarantee": s["guarantee"],
        "limit": s["limit"],
        "held": s["stats"]["core"]["held"],
        "preloaded": os.environ.get("LD_PRELOAD", "").split(":")[0] == os.environ.get("VRAMD_LIB"),
        "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if TORCH:
        import torch
        import vramd_torch

        out["torch_mode"] = vramd_torch.installed()
        out["mem_get_info"] = torch.cuda.mem_get_info()
        out["device"] = torch.cuda.get_device_name()
    else:
        hooked = any(type(f).__name__ == "_Finder" for f in sys.meta_path)
        out["torch_mode"] = os.environ.get("VRAMD_TORCH_MODE") if hooked else None
        out["mem_get_info"] = t.mem_get_info()
    return out


class Holder:
    """An actor holding blocks of device memory (the tenant is set up before __init__)."""

    def __init__(self):
        self.name_at_init = vramd.current().name
        self.blocks = []

    def view(self):
        v = worker_view()
        v["name_at_init"] = self.name_at_init
        v["actor_id"] = __import__("ray").get_runtime_context().get_actor_id()
        return v

    def take(self, nbytes, fill):
        try:
            self.blocks.append((alloc(nbytes, fill), fill))
        except refusal_type() as e:
            return f"refused: {e}"
        return "ok"

    def intact(self):
        return all(intact(b, f) for b, f in self.blocks)

    def drop_last(self):
        b, _ = self.blocks.pop()
        release(b)


def task_body(i):
    """One task: looks at what it starts with, allocates, checks, frees and returns."""
    start = worker_view()
    sock = os.environ["VRAMD_SOCKET"]
    seen = [(x["name"], x["held"]) for x in vramd.status(sock)["tenants"]]
    b = alloc(512 * MiB, i + 1)
    ok = intact(b, i + 1)
    release(b)
    del b
    start.update(ok=ok, tenants_at_start=seen)
    return start


class Trainer:
    """A small model trained on the GPU inside an actor (without torch: a loop of blocks)."""

    def __init__(self):
        self.name = vramd.current().name

    def train(self, steps):
        t0 = time.time()
        if not TORCH:
            losses = []
            for i in range(steps):
                b = alloc(256 * MiB, i % 250 + 1)
                assert intact(b, i % 250 + 1)
                release(b)
                losses.append(1.0 / (i + 1))
            return {"losses": losses, "seconds": time.time() - t0, "peak": None, "name": self.name}
        import torch

        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(
            d_model=512, nhead=8, dim_feedforward=2048, batch_first=True, dropout=0.0
        ).cuda()
        head = torch.nn.Linear(512, 512).cuda()
        params = list(layer.parameters()) + list(head.parameters())
        opt = torch.optim.AdamW(params, lr=3e-4)
        x = torch.randn(32, 256, 512, device="cuda")
        y = torch.randn(32, 256, 512, device="cuda")
        losses = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(head(layer(x)), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        torch.cuda.synchronize()
        return {
            "losses": losses,
            "seconds": time.time() - t0,
            "peak": torch.cuda.max_memory_allocated(),
            "name": self.name,
        }


def matmul_task():
    """A task that runs a matmul (cuBLAS keeps a workspace) and frees its tensors."""
    import torch

    a = torch.randn(1024, 1024, device="cuda")
    c = float((a @ a).sum())
    del a
    return os.getpid(), c


def noop_task():
    return os.getpid()


def task_ends(task, options):
    """Runs `task` with vramd's `options` and says whether its tenant ended: (worker pid, None),
    or (None, the line of the error that names vramd)."""
    import ray

    try:
        pid, _ = ray.get(ray.remote(task).options(**options).remote(), timeout=120)
        return pid, None
    except Exception as e:
        line = [x for x in str(e).splitlines() if "vramd" in x][-1:] or [str(e)[:200]]
        return None, line[0][:300]


# ---- the driver's side ---------------------------------------------------------------------------


class Head:
    """`ray start --head --block` in a session of its own; stopped by killing every process of
    that session by id (as crates/vramd/tests/ray/cluster.py does), never by name."""

    def __init__(self, tmp, resources, cpus, env):
        self.tmp, self.port = tmp, free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = os.path.join(tmp, "ray-head.log")
        cmd = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            f"--port={self.port}", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}",
            "--num-gpus=0", f"--resources={resources}", "--include-dashboard=false",
            "--disable-usage-stats", "--object-store-memory=1000000000",
            f"--temp-dir={os.path.join(tmp, 'ray')}",
        ]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )

    def log(self):
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def wait_up(self, ray, limit_s=120):
        deadline = time.time() + limit_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited ({self.proc.returncode}):\n{self.log()}")
            try:
                ray.init(address=self.address, logging_level="WARNING", _node_ip_address="127.0.0.1")
                break
            except Exception:  # the GCS is not up yet
                time.sleep(0.5)
        else:
            raise RuntimeError(f"the Ray head did not come up in {limit_s} s:\n{self.log()}")
        while time.time() < deadline:
            alive = [n for n in ray.nodes() if n["Alive"]]
            if alive:
                return alive[0]
            time.sleep(0.5)
        raise RuntimeError(f"no live Ray node in {limit_s} s:\n{self.log()}")

    def stop(self):
        sid = self.proc.pid
        for _ in range(20):
            pids = pids_in_sessions({sid})
            if not pids:
                return True
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.2)
        print("warning: Ray processes left running", file=sys.stderr)
        return False


def keep_logs(tmp, dest):
    """Ray's session logs (small files only) and the head's output, for the results."""
    src = os.path.join(tmp, "ray", "session_latest", "logs")
    os.makedirs(dest, exist_ok=True)
    shutil.copy(os.path.join(tmp, "ray-head.log"), dest)
    if os.path.isdir(src):
        shutil.copytree(
            src, os.path.join(dest, "logs"), dirs_exist_ok=True,
            ignore=lambda d, names: [n for n in names if os.path.isfile(os.path.join(d, n))
                                     and os.path.getsize(os.path.join(d, n)) > 4 * MiB],
        )


def gone_times(sock, name, before_held, its_held, limit_s=10):
    """(seconds until `name` is no longer listed, seconds until the device's held memory is down
    by what it held), polled every 5 ms from now."""
    start = time.time()
    t_name = t_mem = None
    while time.time() - start < limit_s and (t_name is None or t_mem is None):
        st = vramd.status(sock)
        now = time.time() - start
        if t_name is None and name not in {t["name"] for t in st["tenants"]}:
            t_name = now
        if t_mem is None and sum(d["held"] for d in st["devices"]) <= before_held - its_held:
            t_mem = now
        time.sleep(0.005)
    return t_name, t_mem


def gib(n):
    return f"{n / GiB:.2f} GiB"


def main():
    global TORCH
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--resources", required=True, help="`vramd ray-resources` output (JSON)")
    ap.add_argument("--cpus", type=int, default=8)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--logs", help="copy Ray's logs here at the end")
    args = ap.parse_args()
    TORCH = not args.no_torch
    # The step's time limit (timeout sends SIGTERM): stop Ray and keep its logs on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sock = os.path.abspath(args.socket)
    res = json.loads(args.resources)

    tmp = tempfile.mkdtemp(prefix="rg-", dir="/tmp")  # short: Ray's socket paths live under it
    # Ray keeps per-user state under ~/.ray: this cluster's is its own.
    os.environ["HOME"] = tmp
    env = {**os.environ, "VRAMD_SOCKET": sock, "RAY_USAGE_STATS_ENABLED": "0"}
    os.environ["VRAMD_SOCKET"] = sock
    import ray

    say("measured", f"ray {ray.__version__} from {ray.__file__}; vramd from {vramd.__file__}; "
        f"libvram {vramd._lib.find()}; torch {'on' if TORCH else 'off'}")
    assert not tenants(sock) and held(sock) == 0, f"the daemon is not empty: {tenants(sock)}"

    head = Head(tmp, args.resources, args.cpus, env)
    ok = False
    try:
        node = head.wait_up(ray)
        got = node["Resources"].get(vr.RESOURCE)
        assert got == res[vr.RESOURCE], (node["Resources"], res)
        say("ok", f"Ray head up with {vr.RESOURCE}={got:.0f} (vramd ray-resources) and {args.cpus} CPUs")

        # --- three actors: two decorated, one plain class given options() -------------------
        ask = dict(memory="4GiB", limit="6GiB")
        Decorated = ray.remote(**vr.options(**ask))(Holder)
        Plain = ray.remote(Holder)
        actors = [Decorated.remote(), Decorated.remote(), Plain.options(**vr.options(**ask)).remote()]
        start = time.time()
        views = ray.get([a.view.remote() for a in actors], timeout=180)
        say("measured", f"three actors up in {time.time() - start:.1f} s")
        names = [v["name"] for v in views]
        for v in views:
            assert v["name"] == v["name_at_init"] == f"ray-actor-{v['actor_id']}", v
            assert (v["guarantee"], v["limit"]) == (4 * GiB, 6 * GiB), v
            assert v["torch_mode"] == "full", v
            assert v["preloaded"], v
        assert len(set(v["pid"] for v in views)) == 3, views
        fills = [3, 5, 7]
        for a, f in zip(actors, fills):
            assert ray.get(a.take.remote(2 * GiB, f), timeout=120) == "ok"
        seen = tenants(sock)
        for v in views:
            t = seen[v["name"]]
            assert (t["guarantee"], t["limit"]) == (4 * GiB, 6 * GiB), t
            assert 2 * GiB <= t["held"] <= 6 * GiB, t
            assert t["pid"] == v["pid"], (t, v)
        views = ray.get([a.view.remote() for a in actors], timeout=60)
        for v in views:
            assert v["mem_get_info"][1] == 6 * GiB, v
        say("ok", "3 actors (2 decorated, 1 plain with .options(**vramd.ray.options(...))), each a tenant "
            "with guarantee 4 GiB, limit 6 GiB, allocator " + views[0]["torch_mode"] + ", 2 GiB each: " +
            ", ".join(f"{n} held {gib(seen[n]['held'])} (outside {gib(seen[n].get('outside', 0))})" for n in names))
        say("ok", "mem_get_info inside the actors: " + ", ".join(
            f"({gib(v['mem_get_info'][0])} free, {gib(v['mem_get_info'][1])} total)" for v in views)
            + (f" on {views[0]['device']}; CUDA_VISIBLE_DEVICES={views[0]['cuda_visible']}" if TORCH else ""))

        # --- past the limit --------------------------------------------------------------------
        a, b, c = actors
        over = ray.get(a.take.remote(5 * GiB, 9), timeout=120)
        assert over.startswith("refused: ") and names[0] in over, over
        assert ray.get(b.intact.remote(), timeout=120), "the neighbour's tensor changed"
        assert ray.get(b.take.remote(GiB, 11), timeout=120) == "ok", "the neighbour cannot allocate"
        assert ray.get(a.take.remote(256 * MiB, 13), timeout=120) == "ok", "the refused actor cannot go on"
        assert ray.get(a.intact.remote(), timeout=120) and ray.get(c.intact.remote(), timeout=120)
        say("ok", f"past its limit: {over.splitlines()[0][:300]}")
        say("ok", "the neighbours' blocks are intact (sums checked), a neighbour took 1 GiB more, "
            "the refused actor 256 MiB more")

        # --- ray.kill and SIGKILL --------------------------------------------------------------
        seen = tenants(sock)

        def end_of(i, kill, what):
            """Ends actor i by `kill` and says how soon the daemon let go of its tenant."""
            before = held(sock)
            kill()
            t_name, t_mem = gone_times(sock, names[i], before, seen[names[i]]["held"])
            assert t_name is not None and t_mem is not None, (t_name, t_mem, tenants(sock))
            say("measured", f"{what}: tenant gone from the daemon in {t_name * 1000:.0f} ms, its "
                f"{gib(seen[names[i]]['held'])} back in {t_mem * 1000:.0f} ms")

        end_of(0, lambda: ray.kill(a), "ray.kill")
        end_of(2, lambda: os.kill(views[2]["pid"], signal.SIGKILL), "SIGKILL of the plain actor's worker")
        assert ray.get(b.intact.remote(), timeout=60), "the survivor's blocks changed"
        end_of(1, lambda: ray.kill(b), "ray.kill of the last")
        assert wait_for(lambda: not tenants(sock) and held(sock) == 0, 10) is not None, tenants(sock)
        say("ok", "all three actors gone: the daemon holds nothing")

        # --- a task five times in a row on a reused worker --------------------------------------
        step = vr.remote(memory="1GiB", limit="2GiB")(task_body)
        runs = []
        start = time.time()
        for i in range(5):
            r = ray.get(step.remote(i), timeout=180)
            left = wait_for(lambda: not tenants(sock), 5)
            assert left is not None, f"task {i}'s tenant outlived it: {tenants(sock)}"
            runs.append(r)
        took = time.time() - start
        pids = [r["pid"] for r in runs]
        rnames = [r["name"] for r in runs]
        assert len(set(rnames)) == 5 and all(n.startswith("ray-task-") for n in rnames), rnames
        assert len(set(pids)) < 5, f"no worker was reused: {pids}"
        for r in runs:
            assert r["ok"], r
            assert r["held"] == 0 and r["tenants_at_start"] == [(r["name"], 0)], r
            assert (r["guarantee"], r["limit"]) == (GiB, 2 * GiB) and r["torch_mode"] == "full", r
        assert held(sock) == 0
        say("ok", f"5 tasks in {took:.1f} s on {len(set(pids))} worker(s) {sorted(set(pids))}: 5 tenants, "
            "each alone on the daemon and starting with 0 held, 512 MiB allocated, checked and freed")

        # --- training in an actor --------------------------------------------------------------
        Train = vr.remote(memory="4GiB", limit="8GiB")(Trainer)
        tr = Train.remote()
        out = ray.get(tr.train.remote(50), timeout=240)
        losses = out["losses"]
        assert len(losses) == 50 and all(math.isfinite(x) for x in losses), losses
        assert losses[-1] < losses[0], losses
        t = tenants(sock)[out["name"]]
        what = "50 AdamW steps of a TransformerEncoderLayer" if TORCH else "50 steps of 256 MiB blocks (no torch)"
        say("ok", f"{what} in an actor in {out['seconds']:.1f} s: loss {losses[0]:.4f} -> "
            f"{losses[-1]:.4f}; tenant {out['name']} held {gib(t['held'])}"
            + (f", PyTorch's peak allocated {gib(out['peak'])}" if out["peak"] is not None else ""))
        before = held(sock)
        ray.kill(tr)
        t_name, t_mem = gone_times(sock, out["name"], before, t["held"])
        say("measured", f"ray.kill of the trainer: tenant gone in {(t_name or -1) * 1000:.0f} ms, "
            f"memory back in {(t_mem or -1) * 1000:.0f} ms")

        # --- probe (does not fail the run): a task whose matmul leaves cuBLAS's workspace -------
        if TORCH:
            pid, refused = task_ends(matmul_task, vr.options(memory="1GiB", limit="2GiB", max_retries=1))
            if refused is None:
                say("measured", f"a task with a matmul ended cleanly (worker {pid})")
            else:
                say("measured", f"a task with a matmul could not end its tenant: {refused}")
                # The next task of that ask finds the leftover and its worker exits (docs/ray.md).
                left = {n: t["pid"] for n, t in tenants(sock).items()}
                after = ray.remote(noop_task).options(**vr.options(memory="1GiB", limit="2GiB", max_retries=1))
                try:
                    ray.get(after.remote(), timeout=120)
                    gone = wait_for(lambda: not tenants(sock) and held(sock) == 0, 5)
                    say("measured", f"the next task of that ask ran; leftover {sorted(left)} "
                        + ("gone" if gone is not None else f"still there: {tenants(sock)}"))
                except Exception as e:
                    say("measured", f"the next task of that ask failed: {str(e).splitlines()[-1][:200]}")
                for n, t in tenants(sock).items():  # whatever is left: its worker, by pid
                    if n in left:
                        os.kill(t["pid"], signal.SIGKILL)
            wait_for(lambda: not tenants(sock) and held(sock) == 0, 10)
            # The same without libvram.so preloaded: cuBLAS's own cudaMalloc is then the
            # process's outside use, not the tenant's allocations (docs/ray.md).
            pid, refused = task_ends(
                matmul_task, vr.options(memory="1GiB", limit="2GiB", max_retries=0, preload=False))
            if refused is None:
                say("measured", f"the same task with preload=False ended cleanly (worker {pid})")
            else:
                say("measured", f"the same task with preload=False could not end: {refused}")
            wait_for(lambda: not tenants(sock) and held(sock) == 0, 10)

        # --- the end ---------------------------------------------------------------------------
        empty = wait_for(lambda: not tenants(sock) and held(sock) == 0, 10)
        assert empty is not None, (tenants(sock), held(sock))
        st = vramd.status(sock)
        d = st["devices"][0]
        say("ok", f"the end: the daemon holds {d['held']} B and lists no tenant (pooled {gib(d['pooled'])}, "
            f"driver_used {d.get('driver_used')}, outside_use {gib(d.get('outside_use', 0))})")
        ok = True
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        raise
    finally:
        try:
            ray.shutdown()
        finally:
            stopped = head.stop()
            if args.logs:
                keep_logs(tmp, args.logs)
            shutil.rmtree(tmp, ignore_errors=True)
            if ok:
                left = wait_for(lambda: not tenants(sock), 5)
                say("ok" if stopped and left is not None else "warning",
                    f"Ray stopped (processes left: {not stopped}); tenants after: {sorted(tenants(sock))}")
    say("ok", "done")


if __name__ == "__main__":
    main()
