#!/usr/bin/env bash
# Usage: tools/metrics-overhead.sh (after cargo build --release). Needs python3. See docs/benchmarks.md.
# Grant-path cost of metrics, and the effect of scraping every 100 ms with 64 busy tenants.
set -euo pipefail
V=${VRAMD:-target/release/vramd}
dir=$(mktemp -d)
start() { # $1: --metrics value
  rm -f "$dir/s.sock" "$dir/d.log"
  "$V" serve --backend host --capacity 16GiB --socket "$dir/s.sock" --metrics "$1" 2> "$dir/d.log" > /dev/null &
  pid=$!
  for _ in $(seq 100); do [ -S "$dir/s.sock" ] && break; sleep 0.05; done
  sleep 0.2
  addr=$(grep -o 'http://[0-9.:]*/metrics' "$dir/d.log" | head -1 || true)
}
trap 'kill $pid $scraper 2>/dev/null || true' EXIT
pid=; scraper=
stop() { kill "$pid"; wait "$pid" || true; }
bench() { # $1 tenants, $2 iterations
  "$V" bench --socket "$dir/s.sock" --tenants "$1" --iterations "$2" --warmup 200 --json 2>/dev/null |
    python3 -c 'import json,sys; r=json.load(sys.stdin)["results"][0]; g=r["grant"]; t=r["round_trip"]; print("grant p50 %7.1f p99 %7.1f us | round trip p50 %7.1f p99 %7.1f us | %6.0f ops/s" % (g["p50_us"], g["p99_us"], t["p50_us"], t["p99_us"], r["ops_per_second"]))'
}
echo "== 1 tenant, 20000 take+return: metrics off vs on (no scraper)"
for order in "off 127.0.0.1:0" "127.0.0.1:0 off" "off 127.0.0.1:0" "127.0.0.1:0 off" "off 127.0.0.1:0" "127.0.0.1:0 off"; do
  for m in $order; do start $m; printf '%-12s ' "$m"; bench 1 20000; stop; done
done
echo "== 64 tenants x 1000 take+return, metrics on: no scraper vs scraping /metrics every 100 ms"
scrape() {
  hostport=${addr#http://}; hostport=${hostport%/metrics}
  python3 "$(dirname "$0")/scrape.py" "$hostport" & scraper=$!
  printf '%-12s ' "scrape 100ms"; bench 64 1000
  kill $scraper; wait $scraper 2>/dev/null || true
}
noscrape() { printf '%-12s ' "no scrape"; bench 64 1000; }
start 127.0.0.1:0
for i in 1 2 3; do noscrape; scrape; scrape; noscrape; done
stop
rm -rf "$dir"
