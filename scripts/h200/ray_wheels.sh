#!/usr/bin/env bash
# Run HERE (a machine that reaches PyPI), not on the GPU machine: packs Ray 2.60.0 for CPython
# 3.12 on x86_64 Linux, and the dependencies that the GPU machine lacks (jsonschema and its own:
# referencing, jsonschema-specifications, rpds-py; attrs too, which it has, in a version new
# enough for them whatever it has), as one site folder in
# `.whl/ray-site.tar.xz`, trimmed to what a one-machine cluster running Python tasks needs, so
# that it travels with a device call beside `.gpu` (carry both; the call carries 64 MiB in all).
# ray_gpu.sh unpacks it into /tmp/raysite and puts it on PYTHONPATH.
#
#   scripts/h200/ray_wheels.sh                       # .whl/ray-site.tar.xz for cp312
#   PYV=3.11 OUTDIR=/tmp/ray311 scripts/h200/ray_wheels.sh   # the same for this machine's 3.11
#
# Taken out of Ray's wheel (79 MB, 201 MB unpacked): ray/jars (the Java worker's jar),
# the dashboard's web client (ray/dashboard/client/build; a cluster started with
# --include-dashboard=false serves no pages), and Ray's libraries built on the core (rllib, tune,
# train, air, data, serve, llm, workflow) with their console scripts. The core (ray/_raylet.so,
# ray/core: gcs_server and raylet, the dashboard agent's modules, the runtime-env agent with its
# bundled aiohttp) stays whole. STRIP=1 also strips the symbol tables off the three large ELF
# files (about 2.5 MB less packed; Ray's crash backtraces would lose function names).
# Environment: PYV (3.12), OUTDIR (.whl), CACHE (downloaded wheels, kept between runs).
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore
cd "$(dirname "$0")/../.."
PYV=${PYV:-3.12}
TAG=cp${PYV/./}
OUTDIR=${OUTDIR:-.whl}
CACHE=${CACHE:-/tmp/vramd-ray-wheels/$TAG}
RAY=ray==2.60.0
DEPS=(jsonschema referencing jsonschema-specifications rpds-py attrs)
PLAT=(--only-binary=:all: --python-version "$PYV" --implementation cp
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)

mkdir -p "$CACHE" "$OUTDIR"
python3 -m pip download --quiet --no-deps "${PLAT[@]}" -d "$CACHE" "$RAY" "${DEPS[@]}"

work=$(mktemp -d /tmp/ray-site-XXXXXX)
trap 'rm -rf "$work"' EXIT
site=$work/site
# pip lays the wheels out as an install would (file modes: gcs_server and raylet executable).
python3 -m pip install --quiet --no-deps --no-index --find-links "$CACHE" --no-compile \
  "${PLAT[@]}" --target "$site" "$RAY" "${DEPS[@]}"
before=$(du -sm "$site" | cut -f1)

rm -rf "$site/bin" "$site/ray/jars" "$site/ray/dashboard/client/build"
for lib in rllib tune train air data serve llm workflow; do rm -rf "${site:?}/ray/$lib"; done
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
if [ "${STRIP:-0}" = 1 ]; then
  strip "$site/ray/_raylet.so" "$site/ray/core/src/ray/gcs/gcs_server" "$site/ray/core/src/ray/raylet/raylet"
fi
after=$(du -sm "$site" | cut -f1)
{
  echo "ray-site.tar.xz: $RAY and ${DEPS[*]} for $TAG manylinux x86_64, trimmed (scripts/h200/ray_wheels.sh)"
  (cd "$site" && ls -d ./*.dist-info | sed 's|^\./|  |')
  echo "unpacked: ${before} MB before trimming, ${after} MB after; STRIP=${STRIP:-0}"
} > "$work/manifest.txt"
cp "$work/manifest.txt" "$site/RAY-SITE.txt"

rm -f "$OUTDIR/ray-site.tar.xz"
tar -C "$site" -cf - . | xz -9e -T0 > "$OUTDIR/ray-site.tar.xz.part"
mv "$OUTDIR/ray-site.tar.xz.part" "$OUTDIR/ray-site.tar.xz"
cat "$work/manifest.txt"
ls -l "$OUTDIR"
du -sh "$OUTDIR"

# .whl/ must not be committed: ignored here, carried to the device call by name.
if [ "$OUTDIR" = .whl ] && ! git check-ignore -q .whl/ray-site.tar.xz 2>/dev/null; then
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  echo "/.whl/" >> "$exclude"
  echo "added /.whl/ to $exclude"
fi
