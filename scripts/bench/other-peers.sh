#!/usr/bin/env bash
# fencelock beside a peer of ../shared/peers/other (kazoo, python-etcd3, etcd's
# lock RPC, PostgreSQL, MariaDB, memcached), same workloads, one run, interleaved
# in rounds; the median by ops/s of each case is kept.
#
# Usage: scripts/bench/other-peers.sh PEER URL [OUT_DIR]
#   PEER: a --system of the peer harness (zookeeper, etcd, etcd-v3lock,
#         postgres-advisory, postgres-lease, mariadb, memcached)
#   URL:  the fencelock backend URL on the same server
# env: RUNS (3), PEERS_DIR (../shared/peers), WORK (/tmp/fencelock-peers)
#
# The peer's contended run is its own: 32 threads, each its own client, 1000
# cycles, the counter in a file. fencelock's is `fencelock bench` (32 tasks of
# one process, 2000 cycles, in-process counter) and, to show cross-process
# behaviour, `--processes 4` (8 tasks each, counter in a file).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PEER=$1
URL=$2
RUNS=${RUNS:-3}
PEERS_DIR=${PEERS_DIR:-$ROOT/../shared/peers}
WORK=${WORK:-/tmp/fencelock-peers}
OUT=${3:-$WORK/$PEER-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
if [ ! -d "$WORK/other" ]; then
    mkdir -p "$WORK"
    cp -r "$PEERS_DIR"/. "$WORK"/
fi
P="$WORK/other"
[ -x "$P/.venv/bin/python" ] || python3 -m venv "$P/.venv"
"$P/.venv/bin/pip" install -q --disable-pip-version-check -r "$P/requirements.txt"
(cd "$ROOT" && cargo build --release -q -p fencelock-cli --features "${FEATURES:-}")
FL="$ROOT/target/release/fencelock"

run() { # label, command… : the JSON lines, tagged with the label
    local label=$1
    shift
    "$@" 2>>"$OUT/stderr.log" | grep '^{' | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    r["label"] = sys.argv[1]
    print(json.dumps(r))' "$label" >>"$OUT/raw.jsonl"
}

for ((i = 1; i <= RUNS; i++)); do
    echo "round $i/$RUNS" >&2
    run "fencelock" "$FL" bench --backend "$URL" --scenario all --json
    run "fencelock 4 processes" "$FL" bench --backend "$URL" --scenario contended --processes 4 --json
    run "$PEER (peer)" "$P/.venv/bin/python" "$P/bench.py" --system "$PEER" --scenario uncontended
    run "$PEER (peer)" "$P/.venv/bin/python" "$P/bench.py" --system "$PEER" --scenario contended
done

python3 - "$OUT/raw.jsonl" "$PEER (peer)" <<'PY' | tee "$OUT/table.md"
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
print("| system | scenario | workers | ops/s (median; runs) | p50 ms | p99 ms | owner switches | correct |")
print("|---|---|---|---|---|---|---|---|")
for (label, sc), (r, all_ops) in sorted(med.items()):
    sw = r.get("owner_switches")
    print(f"| {label} | {sc} | {r.get('workers')} | {r['ops_per_sec']:,.0f} ({', '.join(f'{v:,}' for v in all_ops)}) | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {sw if sw is not None else '–'} | {r['correct']} |")
peer = sys.argv[2]
print()
for sc in ("uncontended", "contended"):
    f, p = med.get(("fencelock", sc)), med.get((peer, sc))
    if f and p:
        line = f"- {sc}: fencelock {f[0]['ops_per_sec'] / p[0]['ops_per_sec']:.1f}x the peer's ops/s"
        if sc == "contended":
            line += f", p99 acquire wait {f[0]['p99_ms'] / p[0]['p99_ms']:.3f} of the peer's"
        print(line)
f4, p = med.get(("fencelock 4 processes", "contended")), med.get((peer, "contended"))
if f4 and p:
    print(f"- contended, fencelock in 4 processes: {f4[0]['ops_per_sec'] / p[0]['ops_per_sec']:.1f}x the peer's ops/s, p99 {f4[0]['p99_ms'] / p[0]['p99_ms']:.3f} of the peer's")
PY
echo "results in $OUT" >&2
