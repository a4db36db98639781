#!/usr/bin/env bash
# One device call: three tenants on one GPU, in pool and full mode and as plain PyTorch.
set -u
R=${OUT:?run on the device machine, where OUT is set}/r
mkdir -p "$R"
for mode in pool full; do
  ( time VRAMD_TENANT_MODE=$mode timeout 240 python3 scripts/torch_on_vramd.py --bin .gpu/bin \
      --out "$R/tenants_$mode" --skip compat allocbench training ) > "$R/tenants_$mode.log" 2>&1
done
rm -f "$R"/*/vramd.sock
tar czf "$OUT/r.tgz" -C "$OUT" r
