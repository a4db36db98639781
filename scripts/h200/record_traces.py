#!/usr/bin/env python3
"""Records PyTorch CUDA memory traces of workloads unlike the shared ones, with PyTorch's own
fragmentation beside each, so that the allocator can be judged on traces it was not tuned on.

Each workload runs twice, each time in a child process: first under PyTorch's default allocator
with its memory history recorded (`_record_memory_history(enabled="all", context=None,
stacks="python", max_entries=400000)`, the settings of ../shared/traces) for about `--seconds` of
steps, then with `expandable_segments:True`, unrecorded, for the same number of steps. A workload
draws its sizes from one seeded generator in the same order in both runs, so both do the same
work. Writes OUT/NAME.pickle.gz (the snapshot, plain dicts and lists, stack frames left out) and
OUT/README.md: the workloads, and a table of PyTorch's peak allocated and reserved bytes and its
fragmentation (1 - peak allocated / peak reserved, `memory_stats()` at the end of each run) in the
layout `vramd replay --compare default,expandable` reads.

Usage: python3 scripts/h200/record_traces.py --out $OUT/traces [--seconds 6 | --steps N]
       [--only NAME ...]
       python3 scripts/h200/record_traces.py --list
"""
import argparse
import gzip
import json
import os
import pickle
import random
import subprocess
import sys
import time

MAX_ENTRIES = 400_000


def dcgan_train(torch, dev, rng):
    """A small DCGAN (64x64 images, 64 feature maps), Adam, batch 32-256 drawn per step."""
    nn = torch.nn
    nz = 100
    gen = nn.Sequential(
        nn.ConvTranspose2d(nz, 512, 4, 1, 0, bias=False), nn.BatchNorm2d(512), nn.ReLU(True),
        nn.ConvTranspose2d(512, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU(True),
        nn.ConvTranspose2d(256, 128, 4, 2, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU(True),
        nn.ConvTranspose2d(128, 64, 4, 2, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(True),
        nn.ConvTranspose2d(64, 3, 4, 2, 1, bias=False), nn.Tanh()).to(dev)
    disc = nn.Sequential(
        nn.Conv2d(3, 64, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True),
        nn.Conv2d(64, 128, 4, 2, 1, bias=False), nn.BatchNorm2d(128), nn.LeakyReLU(0.2, True),
        nn.Conv2d(128, 256, 4, 2, 1, bias=False), nn.BatchNorm2d(256), nn.LeakyReLU(0.2, True),
        nn.Conv2d(256, 512, 4, 2, 1, bias=False), nn.BatchNorm2d(512), nn.LeakyReLU(0.2, True),
        nn.Conv2d(512, 1, 4, 1, 0, bias=False), nn.Flatten()).to(dev)
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-4, betas=(0.5, 0.999))
    loss = nn.BCEWithLogitsLoss()

    def step(_):
        b = rng.choice([32, 64, 128, 256])
        real = torch.randn(b, 3, 64, 64, device=dev)
        fake = gen(torch.randn(b, nz, 1, 1, device=dev))
        ones, zeros = torch.ones(b, 1, device=dev), torch.zeros(b, 1, device=dev)
        opt_d.zero_grad(set_to_none=True)
        (loss(disc(real), ones) + loss(disc(fake.detach()), zeros)).backward()
        opt_d.step()
        opt_g.zero_grad(set_to_none=True)
        loss(disc(fake), ones).backward()
        opt_g.step()

    return step


def vit_serve(torch, dev, rng):
    """timm ViT-B/16 inference in fp16, one request per step, batch 1-256 drawn per step."""
    import timm

    model = timm.create_model("vit_base_patch16_224", pretrained=False).to(dev).half().eval()

    def step(_):
        b = rng.randint(1, 256)
        with torch.inference_mode():
            model(torch.randn(b, 3, 224, 224, device=dev, dtype=torch.half)).float().softmax(-1)

    return step


def unet_train(torch, dev, rng):
    """A diffusion-style UNet (64-512 channels, GroupNorm, attention at the lowest resolution)
    trained to predict noise, bf16 autocast, AdamW; image size 64-256 px and batch 4-16 per step."""
    nn = torch.nn

    class Res(nn.Module):
        def __init__(self, cin, cout):
            super().__init__()
            self.a = nn.Sequential(nn.GroupNorm(32, cin), nn.SiLU(), nn.Conv2d(cin, cout, 3, 1, 1))
            self.b = nn.Sequential(nn.GroupNorm(32, cout), nn.SiLU(), nn.Conv2d(cout, cout, 3, 1, 1))
            self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

        def forward(self, x):
            return self.skip(x) + self.b(self.a(x))

    class Attn(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.norm = nn.GroupNorm(32, c)
            self.attn = nn.MultiheadAttention(c, 8, batch_first=True)

        def forward(self, x):
            n, c, h, w = x.shape
            t = self.norm(x).flatten(2).transpose(1, 2)
            return x + self.attn(t, t, t, need_weights=False)[0].transpose(1, 2).reshape(n, c, h, w)

    class UNet(nn.Module):
        def __init__(self, chans=(64, 128, 256, 512)):
            super().__init__()
            self.inp = nn.Conv2d(3, chans[0], 3, 1, 1)
            self.down = nn.ModuleList()
            self.up = nn.ModuleList()
            c = chans[0]
            for co in chans:
                self.down.append(Res(c, co))
                c = co
            self.mid = nn.Sequential(Res(c, c), Attn(c), Res(c, c))
            for co in reversed(chans):
                self.up.append(Res(c + co, co))
                c = co
            self.out = nn.Conv2d(c, 3, 3, 1, 1)

        def forward(self, x):
            x = self.inp(x)
            skips = []
            for i, d in enumerate(self.down):
                x = d(x)
                skips.append(x)
                if i < len(self.down) - 1:
                    x = nn.functional.avg_pool2d(x, 2)
            x = self.mid(x)
            for i, u in enumerate(self.up):
                s = skips.pop()
                if x.shape[-1] != s.shape[-1]:
                    x = nn.functional.interpolate(x, size=s.shape[-2:], mode="nearest")
                x = u(torch.cat([x, s], 1))
            return self.out(x)

    model = UNet().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(_):
        px = rng.choice([64, 96, 128, 192, 256])
        b = rng.randint(4, 16)
        x = torch.randn(b, 3, px, px, device=dev)
        noise = torch.randn_like(x)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x + noise).float(), noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def llama_generate(torch, dev, rng):
    """A Llama-style model (16 layers, 1024 wide, random weights) generating greedily in bf16 with
    its key-value cache: batch 1-8, prompt 32-512 tokens, 16-96 new tokens per step."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=1024)
    model = transformers.LlamaForCausalLM(config).to(dev, torch.bfloat16).eval()

    def step(_):
        b, prompt, new = rng.randint(1, 8), rng.randint(32, 512), rng.randint(16, 96)
        ids = torch.randint(1, 32000, (b, prompt), device=dev)
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)

    return step


def gpt2_ckpt_train(torch, dev, rng):
    """GPT-2-medium-sized (24 layers, 1024 wide) training from config with gradient checkpointing,
    bf16 autocast, AdamW; batch 4, sequence length 128-1024 per step."""
    import transformers

    config = transformers.GPT2Config(n_embd=1024, n_layer=24, n_head=16, n_positions=1024)
    model = transformers.GPT2LMHeadModel(config).to(dev)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(_):
        ids = torch.randint(0, config.vocab_size, (4, rng.randint(128, 1024)), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def gnn_train(torch, dev, rng):
    """A three-layer GraphSAGE-style network (mean aggregation by index_add_, 128 features, 256
    hidden, 40 classes), Adam, on a random graph of 20k-200k nodes and 5-15 edges per node drawn
    per step: sizes that follow the graph, not a batch size."""
    nn = torch.nn
    layers = nn.ModuleList([nn.Linear(2 * a, b) for a, b in ((128, 256), (256, 256), (256, 40))])
    layers.to(dev)
    opt = torch.optim.Adam(layers.parameters(), lr=1e-3)

    def step(_):
        n = rng.randint(20_000, 200_000)
        e = n * rng.randint(5, 15)
        src = torch.randint(0, n, (e,), device=dev)
        dst = torch.randint(0, n, (e,), device=dev)
        deg = torch.zeros(n, device=dev).index_add_(0, dst, torch.ones(e, device=dev)).clamp_(min=1)
        x = torch.randn(n, 128, device=dev)
        for i, lin in enumerate(layers):
            agg = torch.zeros_like(x).index_add_(0, dst, x[src]) / deg[:, None]
            x = lin(torch.cat([x, agg], 1))
            if i < len(layers) - 1:
                x = torch.relu(x)
        loss = nn.functional.cross_entropy(x, torch.randint(0, 40, (n,), device=dev))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def dlrm_train(torch, dev, rng):
    """A recommendation model: eight embedding-bag tables of 1M x 128 rows with sparse gradients
    (SparseAdam), a dense MLP (Adam), batch 1k-32k per step, 1-40 lookups per bag."""
    nn = torch.nn
    tables = nn.ModuleList([nn.EmbeddingBag(1_000_000, 128, mode="sum", sparse=True)
                            for _ in range(8)]).to(dev)
    mlp = nn.Sequential(nn.Linear(13, 512), nn.ReLU(), nn.Linear(512, 128)).to(dev)
    top = nn.Sequential(nn.Linear(9 * 128, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(),
                        nn.Linear(256, 1)).to(dev)
    sparse = torch.optim.SparseAdam(list(tables.parameters()), lr=1e-3)
    dense = torch.optim.Adam(list(mlp.parameters()) + list(top.parameters()), lr=1e-3)

    def step(_):
        b = rng.choice([1024, 2048, 4096, 8192, 16384, 32768])
        feats = [mlp(torch.randn(b, 13, device=dev))]
        for t in tables:
            per_bag = torch.randint(1, 40, (b,), device=dev)
            offsets = torch.cumsum(per_bag, 0) - per_bag
            idx = torch.randint(0, 1_000_000, (int(per_bag.sum()),), device=dev)
            feats.append(t(idx, offsets))
        out = top(torch.cat(feats, 1))
        loss = nn.functional.binary_cross_entropy_with_logits(
            out, torch.randint(0, 2, (b, 1), device=dev).float())
        sparse.zero_grad(set_to_none=True)
        dense.zero_grad(set_to_none=True)
        loss.backward()
        sparse.step()
        dense.step()

    return step


def lora_finetune(torch, dev, rng):
    """LoRA fine-tuning (peft, rank 16 on the attention projections) of a Llama-style model with
    frozen bf16 weights (24 layers, 2048 wide, random), AdamW; batch 2, sequence 256-2048."""
    import peft
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)
    base = transformers.LlamaForCausalLM(config).to(dev, torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step(_):
        ids = torch.randint(0, 32000, (2, rng.randint(256, 2048)), device=dev)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def hf_training(model_name, torch, dev, rng):
    """The step of scripts/h200/hf_training.py's worker: batch 8, sequence 512-1024 drawn per
    step, bf16 autocast, AdamW, the token ids made on the host and copied over."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hf_training import build_model

    config, model = build_model(model_name)
    model.to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)

    def step(_):
        ids = torch.randint(0, config.vocab_size, (8, rng.randint(512, 1024)), generator=g).to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def hf_gpt2_train(torch, dev, rng):
    """GPT-2-small trained from config with transformers as scripts/h200/hf_training.py trains
    it: batch 8, sequence 512-1024 per step, bf16 autocast, AdamW."""
    return hf_training("gpt2", torch, dev, rng)


def hf_llama_train(torch, dev, rng):
    """The Llama-style model of scripts/h200/hf_training.py (16 layers, 1024 wide) trained from
    config as it trains it: batch 8, sequence 512-1024 per step, bf16 autocast, AdamW."""
    return hf_training("llama", torch, dev, rng)


WORKLOADS = {f.__name__: f for f in (dcgan_train, vit_serve, unet_train, llama_generate,
                                     gpt2_ckpt_train, gnn_train, dlrm_train, lora_finetune,
                                     hf_gpt2_train, hf_llama_train)}


def child(args):
    """Runs one workload in this process and prints its figures as one JSON line."""
    import torch

    dev = torch.device("cuda")
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    if args.record:
        torch.cuda.memory._record_memory_history(
            enabled="all", context=None, stacks="python", max_entries=MAX_ENTRIES)
    step = WORKLOADS[args.child](torch, dev, rng)
    t0 = time.perf_counter()
    steps = 0
    while (steps < args.steps) if args.steps else (time.perf_counter() - t0 < args.seconds):
        step(steps)
        steps += 1
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    stats = torch.cuda.memory_stats()
    out = {"steps": steps, "wall_s": round(wall, 3),
           "peak_allocated": stats["allocated_bytes.all.peak"],
           "peak_reserved": stats["reserved_bytes.all.peak"]}
    if args.record:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        for seg in snap["segments"]:
            seg["frames"] = []
            for b in seg.get("blocks", []):
                b.pop("frames", None)
        trace = snap["device_traces"][0]
        for ev in trace:
            ev.pop("frames", None)
        out["events"] = len(trace)
        out["span_s"] = round((trace[-1]["time_us"] - trace[0]["time_us"]) / 1e6, 2) if trace else 0
        out["ring_full"] = len(trace) >= MAX_ENTRIES
        with gzip.open(os.path.join(args.out, args.child + ".pickle.gz"), "wb") as f:
            pickle.dump(snap, f, protocol=4)
    print("RESULT " + json.dumps(out), flush=True)


def run_child(name, args, record, steps, env_extra):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--out", args.out,
           "--seconds", str(args.seconds), "--seed", str(args.seed)]
    if record:
        cmd.append("--record")
    if steps:
        cmd += ["--steps", str(steps)]
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.update(env_extra)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{name} ({'recorded' if record else env_extra}) exited {p.returncode}:\n"
                       + (p.stderr or p.stdout)[-3000:])


def frag(r):
    return 100.0 * (1.0 - r["peak_allocated"] / r["peak_reserved"])


def write_readme(out, rows):
    gb = lambda n: f"{n / 1e9:.2f} GB"
    lines = [
        "# Traces recorded by scripts/h200/record_traces.py",
        "",
        "Each file is a gzipped PyTorch CUDA memory snapshot of one workload (random weights,",
        "random data, one seeded draw of sizes), recorded with",
        '`_record_memory_history(enabled="all", context=None, stacks="python", max_entries=400000)`',
        "as ../shared/traces are; stack frames are left out.",
        "",
        "| file | workload | steps | events | wall span |",
        "|---|---|---|---|---|",
    ]
    for name, rec, _ in rows:
        doc = " ".join(WORKLOADS[name].__doc__.split())
        ring = " (ring buffer full: the earliest events are lost)" if rec["ring_full"] else ""
        lines.append(f"| {name}.pickle.gz | {doc} | {rec['steps']} | {rec['events']:,}{ring} "
                     f"| {rec['span_s']} s |")
    lines += [
        "",
        "## What PyTorch's own allocator did with them (same workloads, same steps)",
        "",
        "Fragmentation here is `1 - peak allocated / peak reserved`, PyTorch's `memory_stats()`",
        "figures at the end of the run. `expandable` is the same workload and steps with",
        "`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, unrecorded.",
        "",
        "| workload | peak allocated | peak reserved (default) | fragmentation, default "
        "| fragmentation, expandable segments |",
        "|---|---|---|---|---|",
    ]
    for name, rec, exp in rows:
        lines.append(f"| {name} | {gb(rec['peak_allocated'])} | {gb(rec['peak_reserved'])} "
                     f"| {frag(rec):.1f} % | {frag(exp):.1f} % |")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="folder for the traces and README.md")
    ap.add_argument("--seconds", type=float, default=6.0,
                    help="how long the recorded run steps (default 6)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="+", choices=sorted(WORKLOADS), help="these workloads only")
    ap.add_argument("--timeout", type=float, default=240.0,
                    help="seconds a child may run before it is stopped (default 240)")
    ap.add_argument("--list", action="store_true", help="list the workloads and exit")
    ap.add_argument("--child", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)
    ap.add_argument("--record", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=0,
                    help="run this many steps instead of --seconds of them")
    args = ap.parse_args()
    if args.list:
        for name, f in WORKLOADS.items():
            print(f"{name}: {' '.join(f.__doc__.split())}")
        return
    if args.child:
        return child(args)
    if not args.out:
        ap.error("--out is required")
    os.makedirs(args.out, exist_ok=True)
    rows, failed = [], []
    for name in args.only or WORKLOADS:
        t = time.time()
        try:
            rec = run_child(name, args, True, args.steps, {})
            exp = run_child(name, args, False, rec["steps"],
                            {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"{name}: FAILED: {e}", flush=True)
            failed.append(name)
            continue
        rows.append((name, rec, exp))
        print(f"{name}: {rec['steps']} steps, {rec['events']} events over {rec['span_s']} s; "
              f"fragmentation {frag(rec):.1f} % default, {frag(exp):.1f} % expandable "
              f"({time.time() - t:.0f} s)", flush=True)
        write_readme(args.out, rows)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
