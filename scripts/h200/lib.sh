# Sourced by the scripts beside it: $R (the results folder, $OUT/r), `step`, and the machine's
# description in $R/env.txt.
R=${OUT:?run on the device machine, where OUT is set}/r
mkdir -p "$R"
step() { # step NAME SECONDS COMMAND...: runs it with a limit, its output in $R/NAME.log
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  ( time timeout "$limit" "$@" ) > "$R/$name.log" 2>&1
  echo "   exit $?"
}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc
  python3 -c "import torch; print('torch', torch.__version__)"; } > "$R/env.txt" 2>&1
pytorch_peaks() { # PyTorch full-mode peaks on this build: BERT batch 64 deterministic, BERT batch 16, ResNet-50
  BATCH=64 DETERMINISTIC=1 STEPS=80 TAG=bert64 LIMIT=150 bash scripts/h200/training.sh bert 1 full
  TAG=bert16 LIMIT=120 bash scripts/h200/training.sh bert 1 full
  TAG=resnet LIMIT=120 bash scripts/h200/training.sh resnet50 1 full
}
daemon_up() { # daemon_up DIR: a daemon (CUDA, 60 GiB) on DIR/vramd.sock, its log beside; sets S, D
  S=$1/vramd.sock
  printf 'capacity = "60 GiB"\n' > "$1/vramd.toml"
  .gpu/bin/vramd serve --backend cuda --socket "$S" --config "$1/vramd.toml" > "$1/vramd.log" 2>&1 &
  D=$!
  for _ in $(seq 100); do [ -S "$S" ] && break; sleep 0.1; done
}
daemon_down() { kill "$D"; wait "$D" 2>/dev/null; rm -f "$S"; }
bundled_builds() { # sets BUILDS: this build (vramd), then each .gpu/bin/vramd-NAME bundled
  BUILDS=(vramd)
  for b in .gpu/bin/vramd-*; do [ -x "$b" ] && BUILDS+=("$(basename "$b")"); done
}
