#!/usr/bin/env python3
"""GPT-2-small and a Llama-style model trained from config with transformers (random weights,
nothing downloaded), under PyTorch's default allocator, expandable segments and vramd's full mode,
in paired rounds on one GPU: peak device memory as NVML sees it, and throughput.

Each run is a child process: variable sequence length 512-1024 (the same seeded draw in every
run), batch 8, bf16 autocast, AdamW. Full mode runs under `vramd run --torch-mode full` against a
daemon this script starts (CUDA backend). NVML's figure is the device's used memory sampled every
5 ms during the run, less what was used just before it started. Each full-mode run has a daemon of
its own, started before that baseline, so its context and first pool handles are left out (on a
shared node they serve every tenant) while every handle it creates during the run counts, as the
process's own memory counts for PyTorch; no handle cached by an earlier run is reused. With
`--books`, a full-mode run also records its daemon's books (`vramd status`, polled 10 ms apart):
what the tenant held and what the pool held, at most and where the daemon's memory peaked. Runs
with it do not compare throughput: in the one round measured with it (docs/benchmarks.md), full
mode ran at 0.73-0.84 of expandable segments' tokens/s, against 0.86-1.10 without it.
Throughput is tokens per second over the steps after the warm-up. Modes alternate in each round,
and the first mode rotates between rounds; medians over rounds.

Usage: python3 scripts/h200/hf_training.py --vramd .gpu/bin/vramd --out $OUT/hf [--rounds 3]
       [--steps 60] [--warmup 10] [--models gpt2 llama]
Writes OUT/results.json (every run) and OUT/summary.md (the medians and the two checks of
issue 24: full's peak <= expandable's, full's throughput >= 0.98 of default's and expandable's,
the latter judged on the medians of the ratios paired by round).
       python3 scripts/h200/hf_training.py --merge A/results.json B/results.json prints the
summary of several such runs together.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

MODES = ("default", "expandable", "full")
# A further mode: full mode against a daemon whose pool keeps nothing ready ahead of demand (by
# default it keeps up to `[pool] max`), to tell the pool's memory from the allocator's in NVML's
# figure; and full mode against another build of vramd (`--alt-vramd`) or a daemon whose pool
# keeps another amount ready (`--alt-pool-max`), to compare the two paired. And `pool`: `vramd run
# --torch-mode pool`, PyTorch's own caching allocator over memory vramd grants, to tell what full
# mode's own allocation path costs from what vramd's memory does.
EXTRA_MODES = ("full-nopool", "full-alt", "pool")


def build_model(model_name):
    """The model `model_name` ("gpt2" or "llama") from config, random weights, on the host, and its
    config."""
    import transformers

    if model_name == "gpt2":
        config = transformers.GPT2Config(n_positions=1024)
        return config, transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=1024)
    return config, transformers.LlamaForCausalLM(config)


def worker(model_name, steps, warmup, seed):
    import torch

    torch.manual_seed(seed)
    config, model = build_model(model_name)
    dev = torch.device("cuda")
    model.to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = random.Random(seed)
    lengths = [rng.randint(512, 1024) for _ in range(steps)]
    g = torch.Generator().manual_seed(seed)
    tokens, t_timed, t_issued, step_s = 0, 0.0, 0.0, []
    counts = None
    for i, length in enumerate(lengths):
        if i == warmup:
            counts = vramd_counts()
        ids = torch.randint(0, config.vocab_size, (8, length), generator=g).to(dev)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        issued = time.perf_counter()
        torch.cuda.synchronize()
        if i >= warmup:
            step_s.append(time.perf_counter() - t)
            t_timed += step_s[-1]
            t_issued += issued - t
            tokens += 8 * length
    # issued_share: the part of the timed steps' wall time the host spent issuing the work (up
    # to the final synchronize). Near 1 the host paces the step: host-side costs, an allocator's
    # included, show in tokens/s; well under 1 the device does.
    # step_s: each timed step's wall time, in order; every run draws the same lengths, so step i
    # of two runs did the same work and the two can be compared step by step.
    result = {"tokens_per_s": tokens / t_timed, "issued_share": t_issued / t_timed,
              "step_s": step_s, "loss": float(loss)}
    end = vramd_counts()
    if end is not None and counts is not None:
        # What vramd's allocator did over the timed steps: growth, release and fences.
        result["vramd_timed"] = {k: end[k] - counts[k] for k in end if not k.endswith("_peak")}
        result["vramd_peaks"] = {k: end[k] for k in end if k.endswith("_peak")}
        result["vramd_run"] = {k: end[k] for k in end if not k.endswith("_peak")}
    print("RESULT " + json.dumps(result), flush=True)


def vramd_counts():
    """vramd's allocator counters in this process (full mode), or None under PyTorch's own."""
    try:
        import vramd_torch
    except ImportError:
        return None
    if not vramd_torch.installed():
        return None
    stats = vramd_torch.stats()["stats"]
    core = stats["core"]
    keys = ("allocs", "grants", "grant_requests", "returns", "maps", "unmaps", "fences",
            "fence_waits", "fence_queries")
    counts = {k: core[k] for k in keys if k in core}
    # Allocations the thread caches served, and the calls past them with their time (timed only
    # under VRAMD_TIME_CORE=1, `--time-core`; else 0).
    counts.update({k: stats[k] for k in ("fast_allocs", "core_ops", "core_ns") if k in stats})
    # The run's peaks so far (bytes): requested and allocated by the program, held from the daemon.
    counts.update({k: core[k] for k in ("requested_peak", "allocated_peak", "held_peak")
                   if k in core})
    return counts


class Nvml:
    """The device's used memory, sampled on a thread while a run lasts."""

    def __init__(self, index=0):
        self.index = index
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except ImportError:
            # NVML through nvidia-smi (slower samples, the same figure) where pynvml is missing.
            self.nvml = None

    def used(self):
        if self.nvml is not None:
            return self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used
        out = subprocess.run(["nvidia-smi", "-i", str(self.index), "--query-gpu=memory.used",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True)
        return int(out.stdout.strip()) << 20

    def peak_during(self, proc):
        peak = [self.used()]

        def sample():
            while proc.poll() is None:
                peak[0] = max(peak[0], self.used())
                time.sleep(0.005)
        t = threading.Thread(target=sample)
        t.start()
        out, err = proc.communicate()
        t.join()
        return peak[0], out, err


class Books:
    """A full-mode run's daemon, as its own books see it: `vramd status --json` polled on a thread
    while the run lasts; the most the tenants held, the most the pool held, both at the sample
    where the memory the daemon had made (held and pooled) peaked, and the most of the driver's
    used memory and of what in it the daemon could not attribute, as the daemon last read them."""

    def __init__(self, vramd, sock):
        self.cmd = [vramd, "status", "--socket", sock, "--json"]
        self.peak = {"held_max": 0, "pooled_max": 0, "made_max": 0, "held_at_made_max": 0,
                     "pooled_at_made_max": 0, "driver_used_max": 0, "unattributed_max": 0,
                     "samples": 0}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample)
        self.thread.start()

    def sample(self):
        p = self.peak
        while not self.done.is_set():
            out = subprocess.run(self.cmd, capture_output=True, text=True)
            try:
                dev = json.loads(out.stdout)["devices"][0]
            except (ValueError, KeyError, IndexError):
                time.sleep(0.01)
                continue
            p["samples"] += 1
            p["held_max"] = max(p["held_max"], dev["held"])
            p["pooled_max"] = max(p["pooled_max"], dev["pooled"])
            # The driver's reading as the daemon last took it, and what of it nobody explains.
            p["driver_used_max"] = max(p["driver_used_max"], dev.get("driver_used") or 0)
            p["unattributed_max"] = max(p["unattributed_max"], dev.get("unattributed") or 0)
            if dev["device_used"] > p["made_max"]:
                p.update(made_max=dev["device_used"], held_at_made_max=dev["held"],
                         pooled_at_made_max=dev["pooled"])
            time.sleep(0.01)

    def stop(self):
        self.done.set()
        self.thread.join()
        return self.peak


def daemon_up(vramd, folder, pool_max=None):
    """A daemon on the CUDA backend; `pool_max` its `[pool] max` (TOML text), or its default."""
    sock = os.path.join(folder, "vramd.sock")
    with open(os.path.join(folder, "vramd.toml"), "w") as f:
        f.write('capacity = "120 GiB"\n')
        if pool_max is not None:
            f.write(f'[pool]\nmax = {pool_max}\n')
    log = open(os.path.join(folder, "vramd.log"), "w")
    d = subprocess.Popen([vramd, "serve", "--backend", "cuda", "--socket", sock,
                          "--config", os.path.join(folder, "vramd.toml")], stdout=log, stderr=log)
    for _ in range(200):
        if os.path.exists(sock):
            break
        time.sleep(0.05)
    return d, sock


def run(o, nvml, mode, model, tmp):
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if mode == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if o.time_core:
        env["VRAMD_TIME_CORE"] = "1"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", model,
           "--steps", str(o.steps), "--warmup", str(o.warmup)]
    daemon = books = None
    if mode.startswith("full") or mode == "pool":
        folder = tempfile.mkdtemp(prefix="daemon-", dir=tmp)
        vramd = o.alt_vramd if mode == "full-alt" else o.vramd
        pool_max = {"full-nopool": "0", "full-alt": o.alt_pool_max}.get(mode)
        daemon, sock = daemon_up(vramd, folder, pool_max)
        torch_mode = "pool" if mode == "pool" else "full"
        cmd = [vramd, "run", "--socket", sock, "--torch-mode", torch_mode, "--"] + cmd
    time.sleep(1)
    base = nvml.used()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=tmp)
        if daemon is not None and o.books:
            books = Books(vramd, sock)
        peak, out, err = nvml.peak_during(proc)
    finally:
        if books is not None:
            books = books.stop()
        if daemon is not None:
            daemon.terminate()
            daemon.wait(15)
    res = {"mode": mode, "model": model, "exit": proc.returncode, "nvml_peak_bytes": peak - base}
    if books is not None:
        res["daemon_books"] = books
    for line in out.splitlines():
        if line.startswith("RESULT "):
            res.update(json.loads(line[7:]))
    if "tokens_per_s" not in res:
        res["stderr"] = err[-3000:]
        if daemon is not None:
            with open(os.path.join(folder, "vramd.log")) as f:
                res["daemon_log"] = f.read()[-3000:]
    return res


def summary(results, models):
    lines = ["| model | mode | runs | NVML peak (median) | tokens/s (median) | host issuing, share "
             "of step (median) |", "|---|---|---|---|---|---|"]
    checks = []
    for model in models:
        med = {}
        for mode in MODES + EXTRA_MODES:
            ok = [r for r in results if r["model"] == model and r["mode"] == mode
                  and "tokens_per_s" in r]
            if not any(r["model"] == model and r["mode"] == mode for r in results):
                continue
            if not ok:
                lines.append(f"| {model} | {mode} | 0 | failed | failed | - |")
                continue
            peak = statistics.median(r["nvml_peak_bytes"] for r in ok)
            tps = statistics.median(r["tokens_per_s"] for r in ok)
            med[mode] = (peak, tps)
            issued = [r["issued_share"] for r in ok if "issued_share" in r]
            issued = f"{statistics.median(issued):.3f}" if issued else "-"
            lines.append(f"| {model} | {mode} | {len(ok)} | {peak / 2**30:.2f} GiB | {tps:,.0f} "
                         f"| {issued} |")
        if all(m in med for m in MODES):
            # The throughput verdict is on the ratios paired by round: runs of one round ran
            # back to back, so a host that drifts between rounds (or, with --merge, another
            # machine) moves both sides of a ratio; the medians of tokens/s over all runs do not
            # cancel it and are only shown.
            paired = {other: paired_ratios(results, model, other)
                      for other in ("default", "expandable")}
            unpaired = {o: med["full"][1] / med[o][1] for o in paired}
            if all(paired.values()):
                ratio = {o: statistics.median(paired[o]) for o in paired}
                basis = "medians of the ratios paired by round"
            else:
                ratio = unpaired
                basis = "medians of tokens/s: no round ran full mode beside both"
            checks.append(f"- {model}: full's peak {med['full'][0] / 2**30:.2f} GiB against "
                          f"expandable's {med['expandable'][0] / 2**30:.2f} GiB: "
                          f"{'holds' if med['full'][0] <= med['expandable'][0] else 'MISSED'}; "
                          f"throughput {ratio['default']:.3f} of default's, "
                          f"{ratio['expandable']:.3f} of expandable's ({basis}): "
                          f"{'holds' if min(ratio.values()) >= 0.98 else 'MISSED'}")
            if all(paired.values()):
                checks.append(f"  - paired in each round (full's tokens/s over the other mode's in "
                              f"the same round): "
                              f"{len(paired['default'])} / {len(paired['expandable'])} rounds "
                              f"({', '.join(f'{x:.3f}' for x in paired['default'])} / "
                              f"{', '.join(f'{x:.3f}' for x in paired['expandable'])}); the "
                              f"medians of tokens/s over all runs give "
                              f"{unpaired['default']:.3f} / {unpaired['expandable']:.3f}")
        for mode in ("full", "pool"):
            for other in ("default", "expandable"):
                steps = step_ratios(results, model, mode, other)
                if steps:
                    q = statistics.quantiles(steps, n=4) if len(steps) > 1 else steps * 3
                    checks.append(f"  - {mode} over {other}, step by step (the other's time for "
                                  f"step i over {mode}'s, same round): median {q[1]:.3f}, "
                                  f"quartiles {q[0]:.3f}-{q[2]:.3f}, {len(steps)} steps")
    return "\n".join(lines + [""] + checks) + "\n"


def step_ratios(results, model, mode, other):
    """`other`'s time over `mode`'s for each timed step of each round that ran both (above 1:
    `mode` the faster), from runs that recorded their steps."""
    by_round = {}
    for r in results:
        if r["model"] == model and "step_s" in r:
            by_round.setdefault(r["round"], {})[r["mode"]] = r["step_s"]
    return [o / m for runs in by_round.values() if mode in runs and other in runs
            for m, o in zip(runs[mode], runs[other])]


def paired_ratios(results, model, other):
    """Full mode's tokens/s over `other`'s, one ratio per round that has both."""
    by_round = {}
    for r in results:
        if r["model"] == model and "tokens_per_s" in r:
            by_round.setdefault(r["round"], {})[r["mode"]] = r["tokens_per_s"]
    return [m["full"] / m[other] for _, m in sorted(by_round.items()) if "full" in m and other in m]


def read_runs(path):
    """The runs in `path`: a results.json (one list), or the lines a run prints (one run each,
    other lines skipped), as kept when a call ended before results.json was written."""
    with open(path) as f:
        text = f.read()
    try:
        runs = json.loads(text)
    except json.JSONDecodeError:
        runs = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    if not isinstance(runs, list) or not runs or not all(
        isinstance(r, dict) and "round" in r for r in runs
    ):
        sys.exit(f"{path}: neither a results.json nor the runs' printed lines")
    return runs


def merged(paths):
    """The runs of several results files (`read_runs`), each file's rounds after the ones
    before."""
    results, offset = [], 0
    for path in paths:
        runs = read_runs(path)
        for r in runs:
            results.append(dict(r, round=r["round"] + offset))
        offset += 1 + max((r["round"] for r in runs), default=-1)
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker")
    p.add_argument("--vramd", default=".gpu/bin/vramd")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "hf"))
    p.add_argument("--alt-vramd", metavar="PATH",
                   help="the vramd binary of mode full-alt (another build, compared paired; "
                        "default: --vramd)")
    p.add_argument("--alt-pool-max", metavar="SIZE",
                   help='the `[pool] max` of mode full-alt\'s daemon, e.g. "256 MiB" (default: '
                        "the daemon's default)")
    p.add_argument("--time-core", action="store_true",
                   help="time the allocator's calls past its thread caches in full mode "
                        "(VRAMD_TIME_CORE=1: two clock reads a call); core_ns in vramd_timed")
    p.add_argument("--books", action="store_true",
                   help="poll each full-mode daemon's books during the run (its throughput "
                   "then does not compare)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES + EXTRA_MODES)
    p.add_argument("--merge", nargs="+", metavar="RESULTS_JSON",
                   help="print the summary of earlier runs' results.json files together (their "
                        "rounds numbered one after another) instead of running anything")
    o = p.parse_args()
    if o.worker:
        return worker(o.worker, o.steps, o.warmup, o.seed)
    if o.merge:
        return print(summary(merged(o.merge), o.models))
    os.makedirs(o.out, exist_ok=True)
    o.vramd = os.path.abspath(o.vramd)
    if "full-alt" in o.modes:
        if not (o.alt_vramd or o.alt_pool_max):
            p.error("mode full-alt needs --alt-vramd PATH or --alt-pool-max SIZE")
        o.alt_vramd = os.path.abspath(o.alt_vramd or o.vramd)
    if o.alt_pool_max is not None:
        # TOML text: a size with a unit is a string, a bare number of bytes an integer.
        o.alt_pool_max = o.alt_pool_max if o.alt_pool_max.isdigit() else json.dumps(o.alt_pool_max)
    nvml = Nvml()
    results = []
    with tempfile.TemporaryDirectory(prefix="hf-training-") as tmp:
        for rnd in range(o.rounds):
            for model in o.models:
                k = rnd % len(o.modes)
                order = o.modes[k:] + o.modes[:k]
                for mode in order:
                    r = run(o, nvml, mode, model, tmp)
                    r["round"] = rnd
                    results.append(r)
                    print(json.dumps(r)[:300], flush=True)
                    with open(os.path.join(o.out, "results.json"), "w") as f:
                        json.dump(results, f, indent=1)
                    with open(os.path.join(o.out, "summary.md"), "w") as f:
                        f.write(summary(results, o.models))
    text = summary(results, o.models)
    with open(os.path.join(o.out, "summary.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
