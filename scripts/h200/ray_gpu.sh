#!/usr/bin/env bash
# One device call: a one-node Ray 2.60 cluster over a vramd daemon (CUDA backend) with real
# PyTorch (scripts/h200/ray_gpu.py). Needs `.gpu` (../shared/tools/gpu-bundle) and `.whl`
# (scripts/h200/ray_wheels.sh, run here: Ray trimmed, about 20 MB packed) carried. About 2 minutes.
# NO_TORCH=1 makes the checks with vramd's client allocations instead of tensors.
#
# The machine has no Ray: the packed site goes to /tmp/raysite and onto PYTHONPATH, before the
# vramd packages laid out as `pip install ./python` would (/tmp/vramd-py); Ray's workers inherit
# both from `ray start`, and PATH with .gpu/bin, where libvram.so is found beside vramd.
set -u
. "$(dirname "$0")/lib.sh"
[ -f .whl/ray-site.tar.xz ] || { echo "no .whl/ray-site.tar.xz: run scripts/h200/ray_wheels.sh here, carry .whl" | tee "$R/ray_gpu.log"; exit 1; }
rm -rf /tmp/raysite && mkdir -p /tmp/raysite
# Python's tarfile rather than tar: a bare image may lack the xz program.
step ray_site 60 python3 -c "import tarfile; tarfile.open('.whl/ray-site.tar.xz').extractall('/tmp/raysite', filter='tar')"
cat "$R/ray_site.log"
rm -rf /tmp/vramd-py && mkdir -p /tmp/vramd-py && cp -r python/vramd python/vramd_torch /tmp/vramd-py/
export PATH="$PWD/.gpu/bin:$PATH" PYTHONPATH=/tmp/raysite:/tmp/vramd-py
step ray_import 60 python3 -c "import ray, jsonschema, vramd.ray; print(ray.__version__, ray.__file__); print(open('/tmp/raysite/RAY-SITE.txt').read())"
cat "$R/ray_import.log"
mkdir -p "$R/ray"; daemon_up "$R/ray"
vramd ray-resources --socket "$S" > "$R/ray/resources.json" 2>&1
echo "ray-resources: $(cat "$R/ray/resources.json")"
step ray_gpu 300 python3 scripts/h200/ray_gpu.py --socket "$S" --resources "$(cat "$R/ray/resources.json")" \
  --cpus 8 --logs "$R/ray/logs" ${NO_TORCH:+--no-torch}
vramd status --socket "$S" > "$R/ray/status-end.txt" 2>&1
daemon_down
grep -E "^(ok|measured|warning):|Error|error:|Traceback" "$R/ray_gpu.log" | head -60
rm -f "$R"/*/vramd.sock
tar czf "$OUT/r.tgz" -C "$OUT" r
