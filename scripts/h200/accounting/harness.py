"""The accounting checks' harness: starts programs under `vramd run` or plainly, waits for their
READY line, reads `vramd status --json`, NVML (pynvml) and nvidia-smi while they hold memory, kills
them and times the reclaim. Each subcommand writes one JSON file.

  harness.py tenant --name N --limit 4GiB --out F.json [--guarantee G] [--flag=--torch-mode=pool] -- CMD...
  harness.py plain  --name N --out F.json -- CMD...           (no vramd; the program must exit)
  harness.py hog    --out F.json --drv DRV_ALLOC [--hog-gib 20] [--spare-gib 10]
  harness.py speed  --out F.json [--rounds 3] [--limit 16GiB] [--seconds 5]
  harness.py summary --dir R --out summary.json

The daemon's socket: --socket or ACCT_SOCKET; the binary: --vramd or ACCT_VRAMD (.gpu/bin/vramd).
Status fields that are missing are reported as missing, never a crash.
"""

import argparse
import atexit
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (also sets the machine's NCCL/NVSHMEM variables)

MiB, GiB = C.MiB, C.GiB
VRAMD = os.environ.get("ACCT_VRAMD", ".gpu/bin/vramd")
SOCKET = os.environ.get("ACCT_SOCKET")

DEVICE_FIELDS = ("index", "uuid", "capacity", "held", "pooled", "reserved", "free", "device_used",
                 "driver_used", "outside_use", "unattributed", "outside_processes", "deficit",
                 "at_risk")
TENANT_FIELDS = ("id", "name", "gpu", "class", "priority", "guarantee", "limit", "held", "charged",
                 "outside", "in_use", "cached", "pid", "uid", "grants", "returns", "refusals")


# ---------------------------------------------------------------- children, cleaned up on exit

_children = []


def _cleanup(*_):
    for p in _children:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its own group: vramd run and the program
            except OSError:
                pass
    end = time.monotonic() + 4
    for p in _children:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except Exception:
            pass


atexit.register(_cleanup)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # timeout(1): atexit kills the children


def plain_env(extra=None):
    """The environment of a program that must not be a tenant."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("VRAMD_") and k not in ("LD_PRELOAD",)}
    env.update(extra or {})
    return env


class Prog:
    """A program with its output in a log file; READY <pid> and the JSON line before it parsed."""

    def __init__(self, cmd, log, env=None):
        self.cmd, self.log = [str(c) for c in cmd], log
        self.t_start = time.monotonic()
        self.fh = open(log, "w")
        self.p = subprocess.Popen(self.cmd, stdout=self.fh, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=env, process_group=0)
        _children.append(self.p)
        if os.environ.get("ACCT_PGIDS"):  # the driver's safety net: these groups are killed at its end
            with open(os.environ["ACCT_PGIDS"], "a") as f:
                f.write(f"{self.p.pid}\n")
        self.pid = None   # the program's own pid (from READY), not vramd run's
        self.result = None
        self.t_ready = None

    def text(self):
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def poll_ready(self):
        """True once READY was printed; parses the result line."""
        if self.pid is not None:
            return True
        text = self.text()
        for line in text.splitlines():
            if line.startswith("READY "):
                try:
                    self.pid = int(line.split()[1])
                except (IndexError, ValueError):
                    continue
                self.t_ready = time.monotonic()
                self.result = last_json(text)
                return True
        return False

    def wait_ready(self, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.poll_ready():
                return True
            if self.p.poll() is not None:
                return self.poll_ready()
            time.sleep(0.05)
        return False

    def wait_exit(self, timeout):
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_group()
            return None
        self.result = last_json(self.text())
        return self.p.returncode

    def kill_program(self):
        """SIGKILL to the program itself (the tenant), or the group if its pid is unknown."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                return
            except OSError:
                pass
        self.kill_group()

    def kill_group(self):
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.p.wait(timeout=5)
        except Exception:
            pass

    def tail(self, n=3000):
        return self.text()[-n:]

    def finish(self):
        self.kill_group()
        self.fh.close()


def last_json(text):
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def vramd_run(name, limit=None, guarantee=None, flags=(), cmd=()):
    c = [VRAMD, "run", "--socket", SOCKET, "--tenant", name]
    if limit is not None:
        c += ["--limit", str(limit)]
    if guarantee is not None:
        c += ["--guarantee", str(guarantee)]
    return c + list(flags) + ["--"] + list(cmd)


# ---------------------------------------------------------------- what the daemon and NVML say

def status(timeout=5):
    """`vramd status --json`, or {"error": ...}."""
    try:
        r = subprocess.run([VRAMD, "status", "--socket", SOCKET, "--json"], capture_output=True,
                           text=True, timeout=timeout, env=plain_env())
        if r.returncode != 0:
            return {"error": f"rc {r.returncode}: {r.stderr.strip()[-400:]}"}
        return json.loads(r.stdout)
    except Exception as e:
        return {"error": repr(e)[:400]}


def dev0(st):
    d = (st or {}).get("devices") or []
    return d[0] if d else {}


def tenant_of(st, name=None, pid=None):
    for t in (st or {}).get("tenants") or []:
        if (name is not None and t.get("name") == name) or (pid is not None and t.get("pid") == pid):
            return t
    return None


def pick(d, names):
    """The named fields of d; those absent listed under 'missing'."""
    d = d or {}
    out = {k: d[k] for k in names if k in d}
    missing = [k for k in names if k not in d]
    if missing:
        out["missing"] = missing
    return out


def schema(st):
    """Which of the expected status fields the daemon's report lacks."""
    d = dev0(st)
    ts = (st or {}).get("tenants") or []
    return {"device_missing": [k for k in DEVICE_FIELDS if k not in d] if d else "no device",
            "tenant_missing": ([k for k in TENANT_FIELDS if k not in ts[0]] if ts else "no tenant")}


def num(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


_nvml = None


def nvml():
    """Device 0's used/total and the compute processes' used memory, from pynvml (this process is
    not a tenant, so these are the driver's figures)."""
    global _nvml
    try:
        import pynvml
        if _nvml is None:
            pynvml.nvmlInit()
            _nvml = pynvml.nvmlDeviceGetHandleByIndex(0)
        m = pynvml.nvmlDeviceGetMemoryInfo(_nvml)
        procs = {}
        try:
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(_nvml):
                procs[int(p.pid)] = num(p.usedGpuMemory)
        except Exception as e:
            return {"used": int(m.used), "total": int(m.total), "procs": {},
                    "procs_error": repr(e)[:200]}
        return {"used": int(m.used), "total": int(m.total), "procs": procs}
    except Exception as e:
        return {"error": repr(e)[:300], "procs": {}}


def smi():
    try:
        return subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv"], capture_output=True, text=True, timeout=10).stdout
    except Exception as e:
        return repr(e)


def adjusted_used(nv, st):
    """NVML's device used minus the daemon's pool (pooled handles are the daemon's memory, made
    ahead of demand, so they move when the pool refills)."""
    u, p = num(nv.get("used")), num(dev0(st).get("pooled")) or 0
    return None if u is None else u - p


def measure_reclaim(name, pid, base_adj, t0, tol, max_s=3.0, poll_s=0.02):
    """After SIGKILL at t0: when status stops showing the tenant, when NVML stops listing the
    process, and when NVML's device used (less pooled) is back within tol of the baseline."""
    out = {"tenant_gone_ms": None, "nvml_process_gone_ms": None, "nvml_back_ms": None, "polls": 0}
    last_st, last_nv = None, None
    while time.monotonic() - t0 < max_s:
        st, nv = status(), nvml()
        now_ms = round((time.monotonic() - t0) * 1000, 1)
        out["polls"] += 1
        last_st, last_nv = st, nv
        if out["tenant_gone_ms"] is None and "error" not in st and tenant_of(st, name) is None:
            out["tenant_gone_ms"] = now_ms
        if out["nvml_process_gone_ms"] is None and pid not in nv.get("procs", {}):
            out["nvml_process_gone_ms"] = now_ms
        adj = adjusted_used(nv, st) if "error" not in st else None
        if out["nvml_back_ms"] is None and adj is not None and base_adj is not None \
                and adj <= base_adj + tol:
            out["nvml_back_ms"] = now_ms
        if None not in (out["tenant_gone_ms"], out["nvml_process_gone_ms"], out["nvml_back_ms"]):
            break
        time.sleep(poll_s)
    out["after"] = {"device": pick(dev0(last_st), DEVICE_FIELDS),
                    "nvml_used": (last_nv or {}).get("used"),
                    "adjusted_used": adjusted_used(last_nv or {}, last_st or {}),
                    "baseline_adjusted_used": base_adj}
    out["within_3s"] = out["tenant_gone_ms"] is not None and out["nvml_back_ms"] is not None
    return out


def write(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def logpath(out, suffix=""):
    base = out[:-5] if out.endswith(".json") else out
    return f"{base}{suffix}.log"


# ---------------------------------------------------------------- one tenant, checked

def check_tenant(name, limit, cmd, out, guarantee=None, flags=(), ready_timeout=120,
                 ctx_margin=GiB, tol=128 * MiB, env=None, reclaim_s=3.0):
    """Runs CMD under `vramd run --limit`, and checks the issue's criteria while it holds memory:
    it appears in status; held is within its context's size of what NVML says the process uses;
    it was refused with its framework's own OOM error and survived. Then SIGKILL and the reclaim."""
    limit_b = C.size(limit)
    rec = {"name": name, "limit": limit_b, "guarantee": guarantee, "cmd": [str(c) for c in cmd],
           "ctx_margin": ctx_margin, "tolerance": tol}
    st0, nv0 = status(), nvml()
    rec["baseline"] = {"nvml_used": nv0.get("used"), "pooled": dev0(st0).get("pooled"),
                       "status_error": st0.get("error")}
    base_adj = adjusted_used(nv0, st0) if "error" not in st0 else None
    p = Prog(vramd_run(name, limit, guarantee, flags, cmd), logpath(out, ".prog"), env=env)
    ok = p.wait_ready(ready_timeout)
    rec["ready"] = ok
    rec["ready_s"] = round(p.t_ready - p.t_start, 2) if p.t_ready else None
    rec["result"] = p.result
    if not ok:
        rec["exit_code"] = p.p.poll()
        rec["log_tail"] = p.tail()
        p.finish()
        rec["ok"] = False
        write(out, rec)
        return rec
    time.sleep(0.2)
    st, nv = status(), nvml()
    rec["smi"] = smi()
    rec["status_error"] = st.get("error")
    rec["schema"] = schema(st)
    t = tenant_of(st, name) or tenant_of(st, pid=p.pid)
    rec["tenant"] = pick(t, TENANT_FIELDS) if t else None
    rec["device"] = pick(dev0(st), DEVICE_FIELDS)
    rec["nvml"] = {"device_used": nv.get("used"), "process_used": nv["procs"].get(p.pid),
                   "process_listed": p.pid in nv["procs"], "procs": nv["procs"],
                   "error": nv.get("error") or nv.get("procs_error")}
    res = p.result or {}
    held = num((t or {}).get("held"))
    charged = num((t or {}).get("charged"))
    outside = num((t or {}).get("outside"))
    proc = num(nv["procs"].get(p.pid))
    # What vramd accounts to the tenant as its memory: granted handles plus what it created itself
    # and was charged for (charged missing: 0). NVML's figure for the process should exceed it by
    # no more than the process's context (ctx_margin).
    acc = None if held is None else held + (charged or 0)
    c = {"appears": t is not None, "held": held, "charged": charged, "outside": outside,
         "nvml_process_used": proc}
    if acc is not None and proc is not None:
        c["nvml_minus_held"] = proc - held
        c["nvml_minus_accounted"] = proc - acc
        c["held_matches_nvml"] = -tol <= proc - acc <= ctx_margin
    else:
        c["held_matches_nvml"] = None  # one side missing: reported, not guessed
    if outside is not None and "nvml_minus_accounted" in c:
        c["outside_minus_nvml_gap"] = outside - c["nvml_minus_accounted"]
    c["held_le_limit"] = acc <= limit_b if acc is not None else None
    c["with_outside_le_limit"] = (acc + outside <= limit_b
                                  if acc is not None and outside is not None else None)
    c["headroom"] = limit_b - acc if acc is not None else None
    c["refused"] = res.get("refused")
    c["framework_oom"] = res.get("framework_oom")
    c["error_type"] = res.get("error_type") or res.get("error")
    c["allocated_bytes"] = res.get("allocated_bytes")
    c["survived"] = res.get("survived") or res.get("survived_after_free")
    refusals = (t or {}).get("refusals")
    c["vramd_refusals"] = sum(refusals.values()) if isinstance(refusals, dict) else None
    c["refused_by"] = (None if not res.get("refused") else
                       "vramd" if c["vramd_refusals"] else
                       "framework (vramd refused nothing)" if c["vramd_refusals"] == 0 else None)
    views = [res.get("mem_get_info_start"), (res.get("inside_view") or {}).get("cuMemGetInfo")]
    totals = [v.get("total") for v in views if isinstance(v, dict) and "total" in v]
    if isinstance(res.get("memGetInfo_start"), dict):
        totals.append(res["memGetInfo_start"].get("total"))
    if isinstance(res.get("mem_get_info_start"), list):  # torch's (free, total)
        totals.append(res["mem_get_info_start"][1])
    c["view_totals"] = totals
    c["view_total_is_limit"] = bool(totals) and all(x == limit_b for x in totals)
    c["ok"] = bool(c["appears"] and c["held_matches_nvml"] and c["refused"]
                   and c["framework_oom"] and c["survived"] and c["held_le_limit"])
    rec["checks"] = c
    rec["ok"] = c["ok"]
    t0 = time.monotonic()
    p.kill_program()
    rec["reclaim"] = measure_reclaim(name, p.pid, base_adj, t0, tol, max_s=reclaim_s)
    p.finish()
    rec["log_tail"] = p.tail(1500)
    write(out, rec)
    return rec


def cmd_tenant(a):
    check_tenant(a.name, a.limit, a.cmd, a.out, guarantee=a.guarantee, flags=a.flag,
                 ready_timeout=a.ready_timeout, ctx_margin=int(a.ctx_margin_gib * GiB),
                 tol=int(a.tol_mib * MiB))


def cmd_plain(a):
    """A program run plainly (no vramd) to its end; its JSON line recorded."""
    p = Prog(a.cmd, logpath(a.out, ".prog"), env=plain_env())
    rc = p.wait_exit(a.timeout)
    rec = {"name": a.name, "cmd": p.cmd, "exit_code": rc, "result": p.result,
           "seconds": round(time.monotonic() - p.t_start, 2), "log_tail": p.tail(1500)}
    p.finish()
    write(a.out, rec)


# ---------------------------------------------------------------- memory taken outside vramd

def cmd_hog(a):
    """A tenant with guarantee = capacity - spare is declared first; then a plain process (not a
    tenant) takes hog_gib. How long until status shows the outside use, whether at_risk names the
    tenant, whether a borrower's grant is refused meanwhile; then the hog is killed and the
    borrower tries again."""
    rec = {"hog_gib": a.hog_gib, "spare_gib": a.spare_gib}
    st = status()
    cap = num(dev0(st).get("capacity"))
    rec["capacity"] = cap
    if cap is None:
        rec["error"] = f"no capacity in status: {st.get('error')}"
        write(a.out, rec)
        return
    g = (cap - int(a.spare_gib * GiB)) // (2 * MiB) * (2 * MiB)
    rec["guarantee"] = g
    drv = [a.drv, "--step-mib", "256"]

    gt = Prog(vramd_run("guaranteed", g, g, cmd=drv + ["--max-bytes", "1GiB", "--wait"]),
              logpath(a.out, "_guaranteed"))
    rec["guaranteed_ready"] = gt.wait_ready(60)
    rec["guaranteed_result"] = gt.result
    if not rec["guaranteed_ready"]:
        rec["guaranteed_log"] = gt.tail()
    st = status()
    rec["before_hog"] = {"device": pick(dev0(st), DEVICE_FIELDS),
                         "guaranteed": pick(tenant_of(st, "guaranteed"), TENANT_FIELDS)}

    hog = Prog(["python3", os.path.join(HERE, "outside_hog.py"), "--gib", a.hog_gib],
               logpath(a.out, "_hog"), env=plain_env())
    want = (a.hog_gib - 1) * GiB
    seen_t, last = None, None
    while time.monotonic() - hog.t_start < 60:
        hog.poll_ready()
        st = status()
        ou = num(dev0(st).get("outside_use"))
        last = ou
        if seen_t is None and ou is not None and ou >= want:
            seen_t = time.monotonic()
        if seen_t is not None and hog.pid is not None:
            break
        if hog.t_ready is not None and time.monotonic() - hog.t_ready > a.seen_timeout:
            break  # the hog holds its memory; status did not show it in time (or lacks the field)
        if hog.p.poll() is not None and not hog.poll_ready():
            break
        time.sleep(0.1)
    rec["hog_ready"] = hog.pid is not None
    rec["hog_result"] = hog.result
    rec["hog_alloc_s"] = round(hog.t_ready - hog.t_start, 2) if hog.t_ready else None
    rec["outside_use_seen"] = seen_t is not None
    rec["outside_use_last"] = last
    if seen_t is not None and hog.t_ready is not None:
        rec["outside_seen_after_ready_ms"] = round((seen_t - hog.t_ready) * 1000)
    if seen_t is not None:
        rec["outside_seen_after_start_ms"] = round((seen_t - hog.t_start) * 1000)
    st = status()
    d = dev0(st)
    rec["with_hog"] = {"device": pick(d, DEVICE_FIELDS),
                       "guaranteed": pick(tenant_of(st, "guaranteed"), TENANT_FIELDS),
                       "nvml": nvml()}
    at_risk = d.get("at_risk")
    rec["at_risk_names_guaranteed"] = (any(x.get("tenant") == "guaranteed" for x in at_risk)
                                       if isinstance(at_risk, list) else None)
    procs = d.get("outside_processes")
    rec["outside_processes_name_hog"] = (any(x.get("pid") == hog.pid for x in procs)
                                         if isinstance(procs, list) else None)

    def borrower(tag):
        b = Prog(vramd_run(f"borrower-{tag}", "8GiB",
                           cmd=drv + ["--max-bytes", a.borrow, "--wait"]),
                 logpath(a.out, f"_borrower_{tag}"))
        ok = b.wait_ready(60)
        st = status()
        r = {"ready": ok, "result": b.result,
             "tenant": pick(tenant_of(st, f"borrower-{tag}"), TENANT_FIELDS),
             "device": pick(dev0(st), DEVICE_FIELDS)}
        if not ok:
            r["log"] = b.tail()
        b.finish()
        return r

    rec["borrower_with_hog"] = borrower("hog")
    br = rec["borrower_with_hog"].get("result") or {}
    rec["borrower_refused_with_hog"] = br.get("refused")
    rec["borrower_got_with_hog"] = br.get("allocated_bytes")

    t0 = time.monotonic()
    hog.kill_program()
    gone_t = None
    while time.monotonic() - t0 < 10:
        d = dev0(status())
        ou, ar = num(d.get("outside_use")), d.get("at_risk")
        if ou is not None and ou < GiB and not ar:
            gone_t = time.monotonic()
            break
        time.sleep(0.1)
    rec["outside_cleared_after_kill_ms"] = round((gone_t - t0) * 1000) if gone_t else None
    hog.finish()
    rec["after_hog"] = {"device": pick(dev0(status()), DEVICE_FIELDS)}
    rec["borrower_after_hog"] = borrower("after")
    ba = rec["borrower_after_hog"].get("result") or {}
    rec["borrower_got_after_hog"] = ba.get("allocated_bytes")
    gt.kill_program()
    gt.finish()
    rec["ok"] = bool(rec["outside_use_seen"] and rec["at_risk_names_guaranteed"]
                     and rec["borrower_refused_with_hog"]
                     and ba.get("allocated_bytes") == C.size(a.borrow))
    write(a.out, rec)


# ---------------------------------------------------------------- speed, plain against vramd

def cmd_speed(a):
    """Each program alternately plain and under `vramd run --limit`, rounds whose order turns;
    medians and the paired ratio (vramd / plain) per program."""
    progs = {"jax": "speed_jax.py", "cupy": "speed_cupy.py"}
    env_extra = {}
    if a.jax_preallocate is not None:
        env_extra["XLA_PYTHON_CLIENT_PREALLOCATE"] = a.jax_preallocate
    deadline = time.monotonic() + a.budget_s
    runs = []
    rec = {"limit": C.size(a.limit), "seconds": a.seconds, "rounds": a.rounds, "runs": runs,
           "env": env_extra}
    for r in range(a.rounds):
        order = ["plain", "vramd"] if r % 2 == 0 else ["vramd", "plain"]
        for prog, script in progs.items():
            for how in order:
                if time.monotonic() + a.seconds + 25 > deadline:
                    rec["cut_short"] = True
                    break
                cmd = ["python3", os.path.join(HERE, script), "--seconds", a.seconds]
                if how == "vramd":
                    cmd = vramd_run(f"speed-{prog}-{r}", a.limit, cmd=cmd)
                    env = dict(os.environ, **env_extra)
                else:
                    env = plain_env(env_extra)
                p = Prog(cmd, logpath(a.out, f"_{prog}_{how}_{r}"), env=env)
                rc = p.wait_exit(a.seconds + 60)
                res = p.result or {}
                runs.append({"prog": prog, "how": how, "round": r, "exit": rc,
                             "steps_per_s": res.get("steps_per_s"), "result": res,
                             "wall_s": round(time.monotonic() - p.t_start, 2),
                             **({} if res else {"log_tail": p.tail(1500)})})
                p.finish()
                write(a.out, rec)
    summary = {}
    for prog in progs:
        by = {how: [x["steps_per_s"] for x in runs if x["prog"] == prog and x["how"] == how
                    and num(x["steps_per_s"])] for how in ("plain", "vramd")}
        ratios = []
        for r in range(a.rounds):
            v = {x["how"]: x["steps_per_s"] for x in runs if x["prog"] == prog and x["round"] == r}
            if num(v.get("plain")) and num(v.get("vramd")):
                ratios.append(v["vramd"] / v["plain"])
        summary[prog] = {"plain_median": statistics.median(by["plain"]) if by["plain"] else None,
                         "vramd_median": statistics.median(by["vramd"]) if by["vramd"] else None,
                         "paired_ratios": [round(x, 4) for x in ratios],
                         "ratio_median": round(statistics.median(ratios), 4) if ratios else None,
                         "runs": {k: len(v) for k, v in by.items()}}
    rec["summary"] = summary
    write(a.out, rec)


# ---------------------------------------------------------------- summary.json

def _load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except Exception as e:
        return {"missing_file": os.path.basename(path), "error": repr(e)[:200]}


def _tenant_line(j):
    c = j.get("checks") or {}
    rc = j.get("reclaim") or {}
    r = j.get("result") or {}
    t = j.get("tenant") or {}
    return {"ok": j.get("ok"), "ready": j.get("ready"), "appears": c.get("appears"),
            "held": t.get("held"), "outside": t.get("outside", "missing" if t else None),
            "nvml_process_used": (j.get("nvml") or {}).get("process_used"),
            "charged": t.get("charged", "missing" if t else None),
            "nvml_minus_held": c.get("nvml_minus_held"),
            "nvml_minus_accounted": c.get("nvml_minus_accounted"),
            "with_outside_le_limit": c.get("with_outside_le_limit"),
            "held_matches_nvml": c.get("held_matches_nvml"),
            "refused": c.get("refused"), "framework_oom": c.get("framework_oom"),
            "refused_by": c.get("refused_by"), "error_type": c.get("error_type"),
            "allocated_bytes": c.get("allocated_bytes"), "survived": c.get("survived"),
            "view_total_is_limit": c.get("view_total_is_limit"),
            "tenant_gone_ms": rc.get("tenant_gone_ms"), "nvml_back_ms": rc.get("nvml_back_ms"),
            "nvml_process_gone_ms": rc.get("nvml_process_gone_ms"),
            "missing_fields": j.get("schema"),
            **({"fatal": r.get("fatal")} if r.get("fatal") else {})}


def cmd_summary(a):
    R = a.dir
    s = {"env": None, "daemon_start": None, "tenants": {}, "missing_fields": None}
    try:
        with open(os.path.join(R, "env.txt")) as f:
            s["env"] = f.read()[-600:]
    except OSError:
        pass
    st = _load(os.path.join(R, "status_start.json"))
    d = dev0(st)
    s["daemon_start"] = {"capacity": d.get("capacity"), "device": pick(d, DEVICE_FIELDS),
                         "error": st.get("error") or st.get("missing_file")}
    for f in sorted(glob.glob(os.path.join(R, "t_*.json"))):
        name = os.path.basename(f)[2:-5]
        s["tenants"][name] = _tenant_line(_load(f))
        sch = _load(f).get("schema")
        if sch and s["missing_fields"] is None:
            s["missing_fields"] = sch
    o = _load(os.path.join(R, "outside.json"))
    s["outside"] = {k: o.get(k) for k in (
        "ok", "capacity", "guarantee", "hog_alloc_s", "outside_use_seen",
        "outside_seen_after_ready_ms", "outside_seen_after_start_ms",
        "at_risk_names_guaranteed", "outside_processes_name_hog", "borrower_refused_with_hog",
        "borrower_got_with_hog", "outside_cleared_after_kill_ms", "borrower_got_after_hog",
        "error", "missing_file")}
    wh = (o.get("with_hog") or {}).get("device") or {}
    s["outside"]["with_hog"] = {k: wh.get(k) for k in ("free", "outside_use", "unattributed",
                                                        "deficit", "at_risk", "outside_processes")}
    t = _load(os.path.join(R, "ten.json"))
    s["ten"] = {k: t.get(k) for k in ("ok", "capacity", "guarantee", "bytes_each", "all_ready",
                                      "ooms", "all_present", "held_le_guarantee", "sum_held",
                                      "sum_outside", "device", "reclaim", "error", "missing_file")}
    s["ten"]["per_tenant"] = [{k: v for k, v in r.items() if k not in ("log_tail", "error")}
                              for r in t.get("per_tenant") or []]
    sp = _load(os.path.join(R, "speed.json"))
    s["speed"] = sp.get("summary") or {"error": sp.get("error") or sp.get("missing_file"),
                                       "cut_short": sp.get("cut_short")}
    m = _load(os.path.join(R, "mps", "mps_cap.json"))
    s["mps"] = m
    s["steps"] = {}
    try:  # the driver's steps.txt: name, exit status (124: its time limit), seconds, limit
        with open(os.path.join(R, "steps.txt")) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) >= 4:
                    s["steps"][parts[0]] = {"exit": parts[1], "seconds": parts[2],
                                            "limit": parts[3]}
    except OSError:
        pass
    write(a.out, s)


# ---------------------------------------------------------------- main

def main():
    global VRAMD, SOCKET
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vramd", default=VRAMD)
    p.add_argument("--socket", default=SOCKET)
    sub = p.add_subparsers(dest="what", required=True)

    t = sub.add_parser("tenant")
    t.add_argument("--name", required=True)
    t.add_argument("--limit", default="4GiB")
    t.add_argument("--guarantee")
    t.add_argument("--flag", action="append", default=[], help="extra `vramd run` argument")
    t.add_argument("--out", required=True)
    t.add_argument("--ready-timeout", type=float, default=120)
    t.add_argument("--ctx-margin-gib", type=float, default=1.0,
                   help="how far NVML's figure for the process may exceed held (its context)")
    t.add_argument("--tol-mib", type=float, default=128)
    t.add_argument("cmd", nargs=argparse.REMAINDER)
    t.set_defaults(fn=cmd_tenant)

    q = sub.add_parser("plain")
    q.add_argument("--name", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--timeout", type=float, default=90)
    q.add_argument("cmd", nargs=argparse.REMAINDER)
    q.set_defaults(fn=cmd_plain)

    h = sub.add_parser("hog")
    h.add_argument("--out", required=True)
    h.add_argument("--drv", required=True, help="the compiled drv_alloc")
    h.add_argument("--hog-gib", type=int, default=20)
    h.add_argument("--spare-gib", type=float, default=10)
    h.add_argument("--borrow", default="2GiB", help="what the borrower asks for")
    h.add_argument("--seen-timeout", type=float, default=15,
                   help="seconds after the hog is ready to wait for outside_use to show it")
    h.set_defaults(fn=cmd_hog)

    s = sub.add_parser("speed")
    s.add_argument("--out", required=True)
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--limit", default="16GiB")
    s.add_argument("--seconds", type=float, default=5)
    s.add_argument("--budget-s", type=float, default=200)
    s.add_argument("--jax-preallocate", default="false",
                   help="XLA_PYTHON_CLIENT_PREALLOCATE for both conditions ('' = JAX's default)")
    s.set_defaults(fn=cmd_speed)

    m = sub.add_parser("summary")
    m.add_argument("--dir", required=True)
    m.add_argument("--out", required=True)
    m.set_defaults(fn=cmd_summary)

    a = p.parse_args()
    VRAMD, SOCKET = a.vramd, a.socket
    if a.what != "summary" and not SOCKET:
        p.error("no socket: --socket or ACCT_SOCKET")
    if getattr(a, "cmd", None) and a.cmd[0] == "--":
        a.cmd = a.cmd[1:]
    if getattr(a, "jax_preallocate", None) == "":
        a.jax_preallocate = None
    a.fn(a)


if __name__ == "__main__":
    main()
