#!/usr/bin/env bash
# One device call: scripts/h200/matmul_leftover.py with PyTorch's own allocator, then as a tenant
# of a CUDA daemon with vramd's allocator in full mode, without and with libvram.so preloaded
# (as vramd.ray's options preload it into Ray's workers). Needs `.gpu` carried.
set -u
. "$(dirname "$0")/lib.sh"
rm -rf /tmp/vramd-py && mkdir -p /tmp/vramd-py && cp -r python/vramd python/vramd_torch /tmp/vramd-py/
export PATH="$PWD/.gpu/bin:$PATH" PYTHONPATH=/tmp/vramd-py VRAMD_LIB="$PWD/.gpu/bin/libvram.so"
step native 120 python3 scripts/h200/matmul_leftover.py
mkdir -p "$R/m"; daemon_up "$R/m"
step tenant 120 python3 scripts/h200/matmul_leftover.py --socket "$S"
step tenant_preloaded 120 env LD_PRELOAD="$VRAMD_LIB" python3 scripts/h200/matmul_leftover.py --socket "$S"
daemon_down
for f in native tenant tenant_preloaded; do echo "== $f"; cat "$R/$f.log"; done
