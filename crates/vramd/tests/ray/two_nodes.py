"""Driven by tests/ray.rs: a two-node Ray cluster on loopback, each node with its own vramd
daemon (host backend), and tasks and actors that ask for memory through vramd.ray on it. Prints one `ok: ...` line per
check and figures as `measured: ...`; any failed check raises (non-zero exit).

argv: HEAD_SOCKET WORKER_SOCKET HEAD_RESOURCES WORKER_RESOURCES WORKER_DAEMON_PID TMPDIR
"""

import ctypes
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster, held, tenants, wait_for  # noqa: E402

import vramd  # noqa: E402
import vramd.ray as vr  # noqa: E402

HEAD, WORKER, HEAD_RES, WORKER_RES, WORKER_DAEMON, TMP = sys.argv[1:7]
GiB, MiB = 1 << 30, 1 << 20
T0 = time.time()


class Tee:
    """A standard stream, kept as well: Ray prints its autoscaler's warnings to the driver's."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def write(self, text):
        self.seen.append(text)
        return self.inner.write(text)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def text(self):
        return "".join(self.seen)


sys.stdout, sys.stderr = Tee(sys.stdout), Tee(sys.stderr)


def printed():
    return sys.stdout.text() + sys.stderr.text()


def say(kind, msg):
    print(f"{kind}: {msg} [{time.time() - T0:.1f} s]", flush=True)


def expect_error(ref, ray, *words, limit_s=60):
    start = time.time()
    try:
        ray.get(ref, timeout=limit_s)
    except ray.exceptions.GetTimeoutError:
        raise AssertionError(f"no answer within {limit_s} s: a hang") from None
    except Exception as e:
        text = str(e)
        missing = [w for w in words if w not in text]
        assert not missing, f"{missing} not in: {text}"
        return text, time.time() - start
    raise AssertionError("the task succeeded; an error was expected")


def main():
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # What a worker runs, in plain Python: a tenant with the ask, ended with nothing left.
    t = vr.become_tenant("plain-python", memory="256MiB", limit="512MiB", socket=HEAD)
    seen = tenants(HEAD)["plain-python"]
    assert (seen["guarantee"], seen["limit"]) == (256 * MiB, 512 * MiB), seen
    vr.end_tenant(t)
    assert "plain-python" not in tenants(HEAD)
    say("ok", "vramd.ray.become_tenant outside Ray: the tenant with its guarantee and limit, ended by end_tenant")

    cluster = Cluster(TMP)
    try:
        cluster.start_head({"VRAMD_SOCKET": HEAD})
        cluster.start_worker({"VRAMD_SOCKET": WORKER})
        ray.init(address=cluster.address, logging_level="WARNING")
        nodes = cluster.wait_nodes(ray, 2)
        say("measured", "two Ray nodes up")
        # Each node offers what its daemon reported (`vramd ray-resources`, through the script).
        by_mem = {n["Resources"].get(vr.RESOURCE): n["NodeID"] for n in nodes}
        assert set(by_mem) == {json.loads(HEAD_RES)[vr.RESOURCE], json.loads(WORKER_RES)[vr.RESOURCE]}, by_mem
        head_node = by_mem[json.loads(HEAD_RES)[vr.RESOURCE]]
        worker_node = by_mem[json.loads(WORKER_RES)[vr.RESOURCE]]
        on = lambda node: NodeAffinitySchedulingStrategy(node, soft=False)
        sock_of = {HEAD: "head", WORKER: "worker"}

        @vr.remote(memory="2GiB", limit="2560MiB", num_cpus=0)
        class Holder:
            def __init__(self):
                self.blocks = []

            def where(self):
                return sock_of[os.environ["VRAMD_SOCKET"]], os.getpid(), vramd.current().name

            def take(self, size):
                t = vramd.current()
                try:
                    p = t.alloc(size)
                except vramd.VramdError as e:
                    return f"refused: {e}"
                ctypes.memset(p, 0x5A, min(size, 64 * MiB))
                self.blocks.append(p)
                return "ok"

        # Placement by the memory each daemon reported: the head offers 3 GiB, the worker 2.
        a1, a2 = Holder.remote(), Holder.remote()
        w1, w2 = ray.get([a1.where.remote(), a2.where.remote()], timeout=120)
        assert {w1[0], w2[0]} == {"head", "worker"}, (w1, w2)
        small = vr.options(memory="1GiB", limit="1GiB")
        # A caller's runtime_env or resources of None (a wrapper passing its arguments on) keeps
        # vramd's: without them the task would run as no tenant.
        passed_on = vr.options(memory="1GiB", runtime_env=None, resources=None)
        assert passed_on["resources"] == {vr.RESOURCE: 1024}, passed_on
        assert passed_on["runtime_env"]["env_vars"][vr.GUARANTEE_VAR] == str(1 << 30), passed_on
        a3 = Holder.options(**small).remote()
        w3 = ray.get(a3.where.remote(), timeout=120)
        assert w3[0] == "head", w3
        a4 = Holder.options(**small).remote()
        pending = not ray.wait([a4.where.remote()], timeout=3)[0]
        assert pending, "a fourth actor found room where none is left"
        say("ok", f"Ray placed 2+2+1 GiB of actors over 3+2 GiB nodes: {w1[0]}, {w2[0]}, {w3[0]}; the fourth waits")

        head_t, worker_t = tenants(HEAD), tenants(WORKER)
        first_head = a1 if w1[0] == "head" else a2
        first_worker = a2 if first_head is a1 else a1
        wh = w1 if first_head is a1 else w2
        ww = w2 if first_head is a1 else w1
        assert set(head_t) == {wh[2], w3[2]}, head_t
        assert set(worker_t) == {ww[2]}, worker_t
        assert head_t[wh[2]]["guarantee"] == 2 * GiB and head_t[wh[2]]["limit"] == 2560 * MiB
        assert head_t[w3[2]]["guarantee"] == GiB and head_t[w3[2]]["limit"] == GiB
        say("ok", f"each daemon shows its node's actors as tenants with their guarantee and limit: {sorted(head_t)} / {sorted(worker_t)}")

        # Limits: an actor past its limit gets a clean out-of-memory error; the others go on.
        assert ray.get(first_head.take.remote(1792 * MiB)) == "ok"
        over = ray.get(first_head.take.remote(GiB))
        assert over.startswith("refused: vramd: tenant `") and "limit 2.5 GiB" in over, over
        assert ray.get(first_worker.take.remote(GiB)) == "ok"
        assert ray.get(a3.take.remote(512 * MiB)) == "ok"
        assert ray.get(first_head.take.remote(256 * MiB)) == "ok", "the refused actor goes on"
        say("ok", f"over its limit: {over}")
        assert tenants(HEAD)[wh[2]]["held"] == 2 * GiB

        # ray.kill: the memory is back with the node's daemon within 1 s.
        start = time.time()
        ray.kill(first_head)
        gone = wait_for(lambda: wh[2] not in tenants(HEAD), 5)
        assert gone is not None and gone < 1.0, f"ray.kill: tenant still there after {gone} s"
        say("measured", f"ray.kill to the tenant's memory back with the head's daemon: {gone * 1000:.0f} ms")
        # The fourth actor now finds room on the head.
        w4 = ray.get(a4.where.remote(), timeout=120)
        assert w4[0] == "head", w4
        say("ok", "the waiting actor was placed once the killed one's memory was free")

        # SIGKILL of an actor's process.
        os.kill(ww[1], signal.SIGKILL)
        gone = wait_for(lambda: ww[2] not in tenants(WORKER), 5)
        assert gone is not None and gone < 1.0, f"SIGKILL: tenant still there after {gone} s"
        say("measured", f"SIGKILL to the tenant's memory back with the worker's daemon: {gone * 1000:.0f} ms")

        for a in (a3, a4):
            ray.kill(a)
        empty = wait_for(lambda: held(HEAD) == 0 and held(WORKER) == 0 and not tenants(HEAD) and not tenants(WORKER), 5)
        assert empty is not None and empty < 1.0, (tenants(HEAD), tenants(WORKER))
        say("ok", "all actors gone: both daemons hold nothing")

        # A plain Ray actor given options(): a tenant before its __init__, limited to its ask,
        # its memory back with the daemon within 1 s of ray.kill.
        class Plain:
            def __init__(self):
                self.name_at_init = vramd.current().name
                self.blocks = []

            def where(self):
                return self.name_at_init, ray.get_runtime_context().get_actor_id(), os.getpid()

            def take(self, size):
                try:
                    p = vramd.current().alloc(size)
                except vramd.VramdError as e:
                    return f"refused: {e}"
                ctypes.memset(p, 0x5A, min(size, 64 * MiB))
                self.blocks.append(p)
                return "ok"

        decorated = ray.remote(num_cpus=0, **vr.options(memory="1GiB", limit="1536MiB"))(Plain)
        bare = ray.remote(num_cpus=0)(Plain)
        p1 = decorated.options(scheduling_strategy=on(head_node)).remote()
        p2 = bare.options(**vr.options(memory="512MiB", limit="768MiB"), scheduling_strategy=on(worker_node)).remote()
        (n1, id1, _), (n2, id2, _) = ray.get([p1.where.remote(), p2.where.remote()], timeout=120)
        assert (n1, n2) == (f"ray-actor-{id1}", f"ray-actor-{id2}"), (n1, n2)
        s1, s2 = tenants(HEAD)[n1], tenants(WORKER)[n2]
        assert (s1["guarantee"], s1["limit"]) == (GiB, 1536 * MiB), s1
        assert (s2["guarantee"], s2["limit"]) == (512 * MiB, 768 * MiB), s2
        say("ok", f"plain @ray.remote actors with **options(): tenants {n1} (1 GiB, limit 1.5 GiB) and {n2} (512 MiB, limit 768 MiB) before __init__")
        assert ray.get(p1.take.remote(GiB)) == "ok"
        over = ray.get(p1.take.remote(768 * MiB))
        assert over.startswith(f"refused: vramd: tenant `{n1}`") and "limit 1.5 GiB" in over, over
        assert ray.get(p1.take.remote(256 * MiB)) == "ok", "the refused actor goes on"
        assert ray.get(p2.take.remote(768 * MiB)) == "ok"
        assert ray.get(p2.take.remote(MiB)).startswith("refused: "), "past the worker's actor's limit"
        assert tenants(HEAD)[n1]["held"] == 1280 * MiB, tenants(HEAD)[n1]
        say("ok", f"a plain actor past its limit: {over}")
        for actor, sock, name, node in ((p1, HEAD, n1, "head"), (p2, WORKER, n2, "worker")):
            ray.kill(actor)
            gone = wait_for(lambda: name not in tenants(sock) and held(sock) == 0, 5)
            assert gone is not None and gone < 1.0, f"ray.kill of a plain actor: {tenants(sock)} after {gone} s"
            say("measured", f"ray.kill of a plain actor to its memory back with the {node}'s daemon: {gone * 1000:.0f} ms")

        # Ten short tasks in a row on the head: workers reused, nothing carried from one to the next.
        def short_body(i):
            t = vramd.current()
            s = t.stats()
            others = sorted(vramd.status(os.environ["VRAMD_SOCKET"])["tenants"], key=lambda x: x["name"])
            p = t.alloc(192 * MiB)
            ctypes.memset(p, i, 192 * MiB)
            t.free(p)
            return {
                "pid": os.getpid(), "name": s["tenant"], "limit": s["limit"],
                "guarantee": s["guarantee"], "mapped_at_start": s["stats"]["core"]["held"],
                "tenants_at_start": [(x["name"], x["held"]) for x in others],
            }

        @vr.remote(memory="256MiB", limit="512MiB")
        def short(i):
            return short_body(i)

        def ten_in_a_row(call):
            """Ten calls on the head, one after another, each checked to start alone with
            nothing and to leave nothing; the runs and the worker pids."""
            runs = []
            for i in range(10):
                r = ray.get(call(i), timeout=120)
                left = wait_for(lambda: not tenants(HEAD), 1)
                assert left is not None, f"task {i}'s tenant outlived it: {tenants(HEAD)}"
                runs.append(r)
            pids = [r["pid"] for r in runs]
            names = [r["name"] for r in runs]
            assert len(set(pids)) < len(pids), f"no worker was reused: {pids}"
            assert len(set(names)) == 10 and all(n.startswith("ray-task-") for n in names), names
            for r in runs:
                assert r["tenants_at_start"] == [(r["name"], 0)], r
                assert r["mapped_at_start"] == 0 and r["guarantee"] == 256 * MiB and r["limit"] == 512 * MiB, r
            return runs, pids

        runs, pids = ten_in_a_row(lambda i: short.options(scheduling_strategy=on(head_node)).remote(i))
        say("ok", f"ten tasks on {len(set(pids))} worker process(es), ten tenants, each starting with nothing and alone on the daemon")

        # The same with a plain Ray function given options() per call: the worker's tenant, its
        # PyTorch set-up as under `vramd run` (full mode at `import torch`, libvram.so preloaded).
        def plain_short(i):
            r = short_body(i)
            hooked = any(type(f).__name__ == "_Finder" for f in sys.meta_path)
            r["torch"] = (os.environ.get("VRAMD_TORCH_MODE"), hooked)
            r["preloaded"] = os.environ.get("LD_PRELOAD", "").split(":")[0] == os.environ.get("VRAMD_LIB")
            return r

        plain = ray.remote(plain_short)
        ask = vr.options(memory="256MiB", limit="512MiB")
        start = time.time()
        runs, pids = ten_in_a_row(lambda i: plain.options(**ask, scheduling_strategy=on(head_node)).remote(i))
        took = time.time() - start
        for r in runs:
            assert r["torch"] == ("full", True) and r["preloaded"], r
        say("ok", f"ten plain tasks with options() on {len(set(pids))} worker process(es) in {took:.1f} s: ten tenants, each starting with nothing and alone on the daemon, PyTorch's hook set")

        # A task started by a task that asked inherits its runtime_env (Ray passes it on), not
        # its ask: Ray reserved nothing for it, so it is no tenant with the parent's guarantee,
        # and no guarantee is left in its environment for anything it starts.
        def child_body():
            names = {x["name"]: x["guarantee"] for x in vramd.status(os.environ["VRAMD_SOCKET"])["tenants"]}
            return {"pid": os.getpid(), "guarantee_var": os.environ.get("VRAMD_GUARANTEE"), "tenants": names}

        child = ray.remote(num_cpus=0)(child_body)

        @vr.remote(memory="256MiB", limit="512MiB", num_cpus=0)
        def parent():
            me = vramd.current().name
            return me, ray.get(child.options(scheduling_strategy=on(head_node)).remote(), timeout=120)

        before = tenants(HEAD)
        me, seen = ray.get(parent.options(scheduling_strategy=on(head_node)).remote(), timeout=120)
        assert seen["guarantee_var"] is None, seen
        assert me in seen["tenants"] and seen["tenants"][me] == 256 * MiB, (me, seen)
        guaranteed = [n for n, g in seen["tenants"].items() if g and n != me and n not in before]
        assert guaranteed == [], f"the child task holds a guarantee: {seen}"
        say("ok", f"a task started by a task that asked is no tenant with its guarantee: tenants {sorted(seen['tenants'])} while the parent `{me}` ran")

        # PyTorch's integration in a worker, as under `vramd run --torch-mode pool`: libvram.so
        # preloaded into the worker, the allocator installed when torch is imported (a stand-in
        # torch, tests/fake_torch: no GPU here), mem_get_info answering the tenant's view.
        fake = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fake_torch")

        @ray.remote(**vr.options(memory="256MiB", limit="512MiB", torch_mode="pool",
                                 runtime_env={"env_vars": {"PYTHONPATH": f"{fake}:{os.environ['PYTHONPATH']}"}}))
        def with_torch():
            import torch
            import vramd_torch

            return vramd_torch.installed(), torch.cuda.mem_get_info(), vramd_torch._lib.lib().vram_interposing()

        mode, (free, total), interposing = ray.get(with_torch.options(scheduling_strategy=on(head_node)).remote(), timeout=120)
        assert (mode, total, interposing) == ("pool", 512 * MiB, 1), (mode, free, total, interposing)
        assert wait_for(lambda: not tenants(HEAD), 1) is not None, tenants(HEAD)
        say("ok", f"a task with torch_mode='pool': allocator {mode}, libvram.so interposing, mem_get_info ({free}, {total})")

        # A task that ends holding memory fails with vramd's reason; the worker it leaves is not
        # reused: the next task there finds it gone and runs on a fresh one.
        @vr.remote(memory="256MiB", limit="512MiB")
        def leak():
            vramd.current().alloc(64 * MiB)
            return os.getpid()

        text, _ = expect_error(
            leak.options(scheduling_strategy=on(head_node)).remote(), ray,
            "cannot end while its memory is in use: 64 MiB allocated and not freed",
        )
        r = ray.get(short.options(scheduling_strategy=on(head_node)).remote(0), timeout=120)
        assert r["tenants_at_start"] == [(r["name"], 0)] and r["mapped_at_start"] == 0, r
        assert wait_for(lambda: not tenants(HEAD), 1) is not None, tenants(HEAD)
        say("ok", f"a task that kept memory failed ({text.splitlines()[-1]}); the next started with nothing")

        # Bad input: more than any node has. Ray says it cannot schedule it; nothing reaches vramd.
        big = short.options(**vr.options(memory="64GiB")).remote(0)
        warning = "No available node types can fulfill resource request"
        took = wait_for(lambda: warning in printed(), 90, step=0.2)
        assert took is not None, "Ray printed no warning about the 64 GiB request"
        assert not ray.wait([big], timeout=0)[0]
        ray.cancel(big, force=True)
        assert not tenants(HEAD) and not tenants(WORKER)
        line = next(l for l in printed().splitlines() if warning in l)
        say("ok", f"a 64 GiB request stayed unscheduled; Ray warned after {took:.0f} s: {line.strip()}")

        # Fits Ray's books but not the daemon's: memory taken outside Ray. vramd's message.
        outside = vramd.connect(name="outside-ray", guarantee="2GiB", socket=HEAD)
        text, took = expect_error(
            short.options(**vr.options(memory="2GiB"), scheduling_strategy=on(head_node)).remote(0),
            ray, "vramd:", "2 GiB",
        )
        outside.close()
        say("ok", f"admission refused by the head's daemon in {took:.1f} s: {text.splitlines()[-1]}")

        # The worker node's daemon is down: a clear error in the task, not a hang.
        os.kill(int(WORKER_DAEMON), signal.SIGKILL)
        text, took = expect_error(
            short.options(scheduling_strategy=on(worker_node)).remote(0), ray, "vramd:",
        )
        say("ok", f"daemon down: the task failed in {took:.1f} s: {text.splitlines()[-1]}")
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        raise
    finally:
        ray.shutdown()
        cluster.stop()
    say("ok", "done")


main()
