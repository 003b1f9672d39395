#!/usr/bin/env bash
# PostgreSQL advisory and MariaDB GET_LOCK across processes: fencelock beside its
# peer run two ways — as threads of one process (bench.py, as cross-process.sh
# runs it) and as OS processes (peer-processes.py, the shape of fencelock's
# `--processes N`) — and beside the peer's client running fencelock's own
# statements as processes. Tells the client's share of a gap from the
# statements' and the process count's. Interleaved rounds, median by ops/s.
#
# Usage: scripts/bench/sql-processes.sh [OUT_DIR]
# env: CLIENTS ("4 8"), RUNS (3), CYCLES (1000), WORK (/tmp/fencelock-peers; the
#      patched peers of cross-process.sh must be there: run it once, or
#      BACKENDS=postgres-advisory RUNS=1 CLIENTS=2 scripts/bench/cross-process.sh),
#      FENCELOCK (target/release/fencelock), EXTRA ("label=binary …": more
#      fencelock builds to run beside it, e.g. the build before a change)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
RUNS=${RUNS:-3}
CLIENTS=${CLIENTS:-"4 8"}
CYCLES=${CYCLES:-1000}
WORK=${WORK:-/tmp/fencelock-peers}
P="$WORK/cross-process"
FL=${FENCELOCK:-$ROOT/target/release/fencelock}
PY="$P/other/.venv/bin/python"
OUT=${1:-$WORK/sql-processes-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
[ -x "$PY" ] || {
    echo "no patched peers in $P: run scripts/bench/cross-process.sh once" >&2
    exit 1
}
PG="postgres://postgres@127.0.0.1:5432/test?mode=advisory"
MY="mysql://root@127.0.0.1:3306/test?mode=get_lock"
# fencelock creates the functions and tables the "fl" peers call.
"$FL" bench --backend "$PG" --scenario uncontended --cycles 10 --json >/dev/null 2>&1
"$FL" bench --backend "$MY" --scenario uncontended --cycles 10 --json >/dev/null 2>&1

run() { # backend, clients, label, command…
    local backend=$1 n=$2 label=$3 out
    shift 3
    out=$(timeout 300 "$@" 2>>"$OUT/stderr.log" | grep '^{' | tail -1) || true
    [ -n "$out" ] || out='{"error": "no JSON line"}'
    printf '%s\n' "$out" | python3 -c '
import json, sys
r = json.loads(sys.stdin.read())
r.update(bench_backend=sys.argv[1], bench_clients=int(sys.argv[2]), label=sys.argv[3])
open(sys.argv[4], "a").write(json.dumps(r) + "\n")
ops, p99, sw = r.get("ops_per_sec"), r.get("p99_ms"), r.get("owner_switches")
print(f"  {sys.argv[1]} N={sys.argv[2]} {sys.argv[3]}: {ops} ops/s, p99 {p99} ms, switches {sw}", file=sys.stderr)
' "$backend" "$n" "$label" "$OUT/raw.jsonl"
}

for ((round = 1; round <= RUNS; round++)); do
    echo "round $round/$RUNS" >&2
    for n in $CLIENTS; do
        for b in postgres-advisory mariadb-getlock; do
            if [ $b = postgres-advisory ]; then url=$PG peer=postgres-advisory fl=postgres-advisory-fl; else url=$MY peer=mariadb fl=mariadb-fl; fi
            run $b "$n" "fencelock" "$FL" bench --backend "$url" --scenario contended \
                --processes "$n" --workers "$n" --cycles "$CYCLES" --json
            for e in ${EXTRA:-}; do
                run $b "$n" "fencelock ${e%%=*}" "${e#*=}" bench --backend "$url" --scenario contended \
                    --processes "$n" --workers "$n" --cycles "$CYCLES" --json
            done
            run $b "$n" "peer, threads" "$PY" "$P/other/bench.py" --system $peer --scenario contended \
                --workers "$n" --total "$CYCLES" --deadline 120
            run $b "$n" "peer, processes" "$PY" "$ROOT/scripts/bench/peer-processes.py" "$P/other/bench.py" $peer "$n" "$CYCLES"
            run $b "$n" "peer's client, fencelock's statements, processes" "$PY" "$ROOT/scripts/bench/peer-processes.py" "$P/other/bench.py" $fl "$n" "$CYCLES"
        done
    done
done

python3 - "$OUT/raw.jsonl" <<'PY' | tee "$OUT/table.md"
import json, sys
from collections import defaultdict
runs, order = defaultdict(list), []
for line in open(sys.argv[1]):
    r = json.loads(line)
    k = (r["bench_backend"], r["bench_clients"], r["label"])
    if k not in runs:
        order.append(k)
    runs[k].append(r)
print("| backend | clients | what | ops/s (median; runs) | p50 wait ms | p99 wait ms | owner switches | correct |")
print("|---|---|---|---|---|---|---|---|")
for k in sorted(order, key=lambda k: (k[0], k[1], order.index(k))):
    rs = runs[k]
    ok = [r for r in rs if r.get("ops_per_sec")]
    if not ok:
        print(f"| {k[0]} | {k[1]} | {k[2]} | failed | | | | |")
        continue
    ok.sort(key=lambda r: r["ops_per_sec"])
    m = ok[len(ok) // 2]
    allruns = ", ".join(f"{r['ops_per_sec']:,.0f}" for r in rs if r.get("ops_per_sec"))
    correct = "yes" if all(r.get("correct") for r in rs) else "NO"
    print(f"| {k[0]} | {k[1]} | {k[2]} | {m['ops_per_sec']:,.0f} ({allruns}) | {m.get('p50_ms')} | {m.get('p99_ms')} | {m.get('owner_switches')} | {correct} |")
PY
