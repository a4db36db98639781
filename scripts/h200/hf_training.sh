#!/usr/bin/env bash
# One device call: GPT-2-small and a Llama-style model trained from config under PyTorch's
# default allocator, expandable segments and vramd's full mode, paired rounds (see
# scripts/h200/hf_training.py). Needs torch and transformers; NVML through pynvml, else
# nvidia-smi. Nothing is downloaded. ROUNDS (3), STEPS (60) and LIMIT (540 s) as the
# environment says; results.json and summary.md are rewritten after every run, so a run cut
# short by LIMIT still leaves the rounds it finished in $OUT/r.tgz.
set -u
. "$(dirname "$0")/lib.sh"
step hf_training "${LIMIT:-540}" python3 scripts/h200/hf_training.py --vramd .gpu/bin/vramd \
  --out "$R/hf" --rounds "${ROUNDS:-3}" --steps "${STEPS:-60}"
cat "$R/hf/summary.md" 2>/dev/null
tar czf "$OUT/r.tgz" -C "$OUT" r
