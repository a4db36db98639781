#!/usr/bin/env bash
# One device call: every GPU test, the CUDA read-only and kept-import measurements with their
# figures printed, a Ray worker's tenant setup with real PyTorch (scripts/h200/become_tenant.py,
# without Ray; ray_gpu.sh runs it under Ray), and GPT-2 / Llama-style training in full mode
# with and without the daemon's ready pool beside expandable segments (hf_training.py), and
# PyTorch's compatibility checks in both modes. About 9 minutes; HF=0 leaves the training out,
# COMPAT=0 the compatibility checks.
set -u
. "$(dirname "$0")/lib.sh"
step gpu_tests 200 bash .gpu/run
for t in .gpu/tests/gpu_shared-* .gpu/tests/gpu_daemon-*; do
  for name in a_reader_that_makes_a_version_writable an_import_kept_after_its_return; do
    "$t" --test-threads=1 --nocapture "$name" 2>&1 | grep -E "MEASURED|test result|panicked"
  done
done > "$R/measured.log" 2>&1
cat "$R/measured.log"
mkdir -p "$R/bt"; daemon_up "$R/bt"
# The two packages as `pip install ./python` lays them out (python/ also holds the sitecustomize
# that only `vramd run` puts on PYTHONPATH).
rm -rf /tmp/vramd-py && mkdir -p /tmp/vramd-py && cp -r python/vramd python/vramd_torch /tmp/vramd-py/
( export PATH="$PWD/.gpu/bin:$PATH" PYTHONPATH=/tmp/vramd-py
  step become_tenant 90 python3 scripts/h200/become_tenant.py "$S" )
daemon_down; cat "$R/become_tenant.log"
if [ "${COMPAT:-1}" != 0 ]; then
  step compat 150 python3 scripts/torch_on_vramd.py --bin .gpu/bin --out "$R/compat" --skip training tenants
  cat "$R/compat/results.md" 2>/dev/null
fi
if [ "${HF:-1}" != 0 ]; then
  step hf_pool "${LIMIT:-330}" python3 scripts/h200/hf_training.py --vramd .gpu/bin/vramd \
    --out "$R/hf" --rounds 2 --steps 40 --models gpt2 llama --modes expandable full full-nopool
  cat "$R/hf/summary.md" 2>/dev/null
fi
rm -f "$R"/*/vramd.sock
tar czf "$OUT/r.tgz" -C "$OUT" r
