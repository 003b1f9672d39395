#!/usr/bin/env bash
# fencelock beside the Redis lock peers, same workloads, one run, interleaved:
#   redis-benchmark -c 1 SET (the two-round-trip floor = its ops/s ÷ 2),
#   fencelock (1 process × 32 tasks, and 4 processes × 8 tasks),
#   rslock, redis-py Lock and node-redlock (1 instance) with the in-process
#   counter workload (--counter local).
# Each case runs RUNS times (default 3) in rounds; the median by ops/s is kept.
#
# Needs the peer harnesses of ../shared/peers (copied to a work dir, never into
# the project) and Redis on 127.0.0.1:6379 (scripts/services.sh).
# Usage: scripts/bench/redis-peers.sh [OUT_DIR]      (env: RUNS, PEERS_DIR, WORK)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
RUNS=${RUNS:-3}
PEERS_DIR=${PEERS_DIR:-$ROOT/../shared/peers}
WORK=${WORK:-/tmp/fencelock-peers}
OUT=${1:-$WORK/results-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"

if [ ! -d "$WORK/redis" ]; then
    mkdir -p "$WORK"
    cp -r "$PEERS_DIR"/. "$WORK"/
fi
P="$WORK/redis"
(cd "$P/rust_peers" && cargo build --release --locked -q)
[ -x "$P/.venv/bin/python" ] || python3 -m venv "$P/.venv"
"$P/.venv/bin/pip" install -q --disable-pip-version-check -r "$P/py_peers/requirements.txt"
[ -d "$P/node_peers/node_modules/redlock" ] || (cd "$P/node_peers" && npm ci --no-audit --no-fund --loglevel=error)
(cd "$ROOT" && cargo build --release -q -p fencelock-cli)
FL="$ROOT/target/release/fencelock"
URL=redis://127.0.0.1:6379

run() { # label, command… : one JSON line tagged with the label
    local label=$1
    shift
    "$@" 2>>"$OUT/stderr.log" | grep '^{' | python3 -c '
import json, sys
label = sys.argv[1]
for line in sys.stdin:
    r = json.loads(line)
    r["label"] = label
    print(json.dumps(r))' "$label" >>"$OUT/raw.jsonl"
}

for ((i = 1; i <= RUNS; i++)); do
    echo "round $i/$RUNS" >&2
    run floor python3 "$P/scripts/redis_benchmark_json.py" 100000 1
    run "fencelock" "$FL" bench --backend "$URL" --scenario all --json
    run "fencelock 4 processes" "$FL" bench --backend "$URL" --scenario contended --processes 4 --json
    run "fencelock 4 processes" "$FL" bench --backend "$URL" --scenario handoff --processes 4 --json
    run rslock "$P/rust_peers/target/release/rust_peers" --system rslock --scenario uncontended --counter local
    run rslock "$P/rust_peers/target/release/rust_peers" --system rslock --scenario contended --counter local
    run redis-py "$P/.venv/bin/python" "$P/py_peers/bench.py" --scenario uncontended --counter local
    run redis-py "$P/.venv/bin/python" "$P/py_peers/bench.py" --scenario contended --counter local
    run node-redlock node "$P/node_peers/bench.mjs" --scenario uncontended --instances 1 --counter local
    run node-redlock node "$P/node_peers/bench.mjs" --scenario contended --instances 1 --counter local
done

python3 - "$OUT/raw.jsonl" <<'PY' | tee "$OUT/table.md"
import json, statistics, sys
from collections import defaultdict
runs = defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    runs[(r["label"], r.get("scenario"))].append(r)
med = {}
for k, rs in runs.items():
    rs.sort(key=lambda r: r.get("ops_per_sec") or 0)
    med[k] = (rs[len(rs) // 2], [round(r.get("ops_per_sec") or 0) for r in rs])
floor = med.get(("floor", "set_c1"))
floor_ops = floor[0]["ops_per_sec"] / 2 if floor else None
print("| system | scenario | ops/s (median; runs) | p50 ms | p99 ms | owner switches | correct |")
print("|---|---|---|---|---|---|---|")
if floor:
    print(f"| two-round-trip floor (redis-benchmark -c 1 SET ÷ 2) | – | {floor_ops:,.0f} ({', '.join(f'{v / 2:,.0f}' for v in floor[1])}) | – | – | – | – |")
for (label, sc), (r, all_ops) in sorted(med.items()):
    if label == "floor":
        continue
    sw = r.get("owner_switches")
    print(f"| {label} | {sc} | {r['ops_per_sec']:,.0f} ({', '.join(f'{v:,}' for v in all_ops)}) | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {sw if sw is not None else '–'} | {r['correct']} |")
fl = {sc: med[("fencelock", sc)][0] for sc in ("uncontended", "contended", "handoff") if ("fencelock", sc) in med}
peers = {k: v[0] for k, v in med.items() if k[0] in ("rslock", "redis-py", "node-redlock")}
best = max((r for (l, sc), r in peers.items() if sc == "contended"), key=lambda r: r["ops_per_sec"], default=None)
print()
if floor_ops and "uncontended" in fl:
    print(f"- uncontended vs floor: {fl['uncontended']['ops_per_sec'] / floor_ops:.2f} (target ≥ 0.85)")
if best and "contended" in fl:
    print(f"- contended vs best peer ({best['system']}): {fl['contended']['ops_per_sec'] / best['ops_per_sec']:.1f}× ops/s (target ≥ 2), "
          f"p99 {fl['contended']['p99_ms'] / best['p99_ms']:.3f} of its p99 (target ≤ 0.1)")
if "handoff" in fl:
    rtt_ms = 1000 / floor[0]["ops_per_sec"] if floor else None
    if rtt_ms:
        print(f"- handoff p50 {fl['handoff']['p50_ms']:.3f} ms = {fl['handoff']['p50_ms'] / rtt_ms:.1f} round trips of {rtt_ms:.3f} ms (target ≤ 3)")
PY
echo "results in $OUT" >&2
