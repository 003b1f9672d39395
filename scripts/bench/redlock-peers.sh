#!/usr/bin/env bash
# fencelock's Redlock beside the Redlock peers on the same 5 instances
# (127.0.0.1:7001–7005, started by scripts/services.sh), same workloads, one
# run, interleaved: fencelock redlock:// (all scenarios), rslock --instances 5
# and node-redlock --instances 5 with the in-process counter (--counter local).
# Each case runs RUNS times (default 3) in rounds; the median by ops/s is kept.
#
# Needs the peer harnesses of ../shared/peers (copied to a work dir, never into
# the project) and Redis on 127.0.0.1:6379 (scripts/services.sh).
# Usage: scripts/bench/redlock-peers.sh [OUT_DIR]    (env: RUNS, PEERS_DIR, WORK)
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
URL=redlock://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003,127.0.0.1:7004,127.0.0.1:7005

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
    run "fencelock redlock" "$FL" bench --backend "$URL" --scenario all --json
    run "rslock x5" "$P/rust_peers/target/release/rust_peers" --system rslock --instances 5 --scenario uncontended --counter local
    run "rslock x5" "$P/rust_peers/target/release/rust_peers" --system rslock --instances 5 --scenario contended --counter local
    run "node-redlock x5" node "$P/node_peers/bench.mjs" --instances 5 --scenario uncontended --counter local
    run "node-redlock x5" node "$P/node_peers/bench.mjs" --instances 5 --scenario contended --counter local
done

python3 - "$OUT/raw.jsonl" <<'PY' | tee "$OUT/table.md"
import json, sys
from collections import defaultdict
runs = defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    runs[(r["label"], r.get("scenario"))].append(r)
med = {}
for k, rs in runs.items():
    rs.sort(key=lambda r: r.get("ops_per_sec") or 0)
    med[k] = (rs[len(rs) // 2], [round(r.get("ops_per_sec") or 0) for r in rs])
print("| system | scenario | ops/s (median; runs) | p50 ms | p99 ms | owner switches | correct |")
print("|---|---|---|---|---|---|---|")
for (label, sc), (r, all_ops) in sorted(med.items()):
    sw = r.get("owner_switches")
    print(f"| {label} | {sc} | {r['ops_per_sec']:,.0f} ({', '.join(f'{v:,}' for v in all_ops)}) | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {sw if sw is not None else '–'} | {r['correct']} |")
fl = med.get(("fencelock redlock", "contended"), (None,))[0]
peers = [v[0] for k, v in med.items() if k[0] != "fencelock redlock" and k[1] == "contended"]
best = max(peers, key=lambda r: r["ops_per_sec"], default=None)
print()
if fl and best:
    print(f"- contended vs best peer ({best['system']}): {fl['ops_per_sec'] / best['ops_per_sec']:.1f}x ops/s (target >= 2), "
          f"p99 {fl['p99_ms'] / best['p99_ms']:.3f} of its p99 (target <= 0.1)")
PY
echo "results in $OUT" >&2
