#!/usr/bin/env bash
# Cross-process contention, side by side: for each backend and N clients,
#   fencelock: `fencelock bench --scenario contended --processes N --workers N`
#              (N OS processes, one task each, counter in a file, merged history
#              checked),
#   its peers: N independent clients (each worker its own client/connection)
#              on the same number of cycles, a counter under the lock.
# Rounds are interleaved (each round runs every case once); the median by ops/s
# of each case is kept. Writes raw.jsonl, stderr.log and table.md in the out dir
# and prints the table.
#
# Peers come from ../shared/peers, copied to $WORK/cross-process (never into the
# project; not $WORK/redis or $WORK/other, so the other scripts keep unpatched
# peers) and patched there with scripts/bench/peer-patches/*.patch (applied once:
# a patch that already reverse-applies is skipped):
#   rust_peers.patch  rslock: one LockManager (own connections) per worker instead
#                     of one shared by all tasks; own counter connection
#   node_peers.patch  node-redlock: own ioredis clients + Redlock per worker
#   py_peers.patch    redis-py: own redis.Redis client per thread, not one pool
#   other.patch       other/bench.py: records the worker of each grant inside the
#                     critical section and reports owner_switches
#   rmw.patch         other/bench.py: the counter file read and written back in
#                     place, as fencelock's bench does (a file truncated and
#                     rewritten costs ~170 us on ext4, inside the critical section)
#   rust_ring.patch   rust_peers' `ring`: N processes pass one token around a
#                     ring through Redis (BLPOP/RPUSH) — the fair-handoff floor
#                     across processes, run beside the Redis peers ("fair ring")
# Every peer's wait is timed from its first attempt to the grant (the library's
# own wait/retry loop runs inside the timed call).
#
# Usage: scripts/bench/cross-process.sh [OUT_DIR]
# env: CLIENTS ("2 4 8 16"), BACKENDS (redis redlock zookeeper etcd postgres-lease
#      postgres-advisory mariadb-lease mariadb-getlock memcached), CYCLES (1000),
#      RUNS (3), PEERS_DIR (../shared/peers), WORK (/tmp/fencelock-peers),
#      DEADLINE (300: seconds a python peer may run), RUN_TIMEOUT (DEADLINE+60),
#      FENCELOCK (a built fencelock binary: skips the cargo build)
# Needs the services of scripts/services.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
RUNS=${RUNS:-3}
CLIENTS=${CLIENTS:-"2 4 8 16"}
BACKENDS=${BACKENDS:-"redis redlock zookeeper etcd postgres-lease postgres-advisory mariadb-lease mariadb-getlock memcached"}
CYCLES=${CYCLES:-1000}
DEADLINE=${DEADLINE:-300}
RUN_TIMEOUT=${RUN_TIMEOUT:-$((DEADLINE + 60))}
PEERS_DIR=${PEERS_DIR:-$ROOT/../shared/peers}
WORK=${WORK:-/tmp/fencelock-peers}
P="$WORK/cross-process"
OUT=${1:-$WORK/cross-process-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"

url_of() {
    case $1 in
        redis) echo "redis://127.0.0.1:6379" ;;
        redlock) echo "redlock://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003,127.0.0.1:7004,127.0.0.1:7005" ;;
        zookeeper) echo "zk://127.0.0.1:2181" ;;
        etcd) echo "etcd://127.0.0.1:2379" ;;
        postgres-lease) echo "postgres://postgres@127.0.0.1:5432/test?mode=lease" ;;
        postgres-advisory) echo "postgres://postgres@127.0.0.1:5432/test?mode=advisory" ;;
        mariadb-lease) echo "mysql://root@127.0.0.1:3306/test?mode=lease" ;;
        mariadb-getlock) echo "mysql://root@127.0.0.1:3306/test?mode=get_lock" ;;
        memcached) echo "memcached://127.0.0.1:11211" ;;
        *)
            echo "unknown backend $1" >&2
            return 1
            ;;
    esac
}
need_redis_peers=0
need_other_peers=0
for b in $BACKENDS; do
    url_of "$b" >/dev/null
    case $b in
        redis | redlock) need_redis_peers=1 ;;
        *) need_other_peers=1 ;;
    esac
done

# --- the patched copy of the peers ---
if [ ! -e "$P/.copied" ]; then
    mkdir -p "$P"
    cp -r "$PEERS_DIR"/. "$P"/
    chmod -R u+w "$P"
    touch "$P/.copied"
fi
for f in "$ROOT"/scripts/bench/peer-patches/*.patch; do
    if patch -d "$P" -p1 -R --dry-run -s -f <"$f" >/dev/null 2>&1; then
        continue # already applied
    fi
    patch -d "$P" -p1 --forward -s <"$f" || {
        echo "$f does not apply to $P (patched by an older version?): delete $P and run again" >&2
        exit 1
    }
done
if [ "$need_redis_peers" = 1 ]; then
    (cd "$P/redis/rust_peers" && cargo build --release --locked -q)
    [ -x "$P/redis/.venv/bin/python" ] || python3 -m venv "$P/redis/.venv"
    "$P/redis/.venv/bin/pip" install -q --disable-pip-version-check -r "$P/redis/py_peers/requirements.txt"
    [ -d "$P/redis/node_peers/node_modules/redlock" ] || (cd "$P/redis/node_peers" && npm ci --no-audit --no-fund --loglevel=error)
fi
if [ "$need_other_peers" = 1 ]; then
    [ -x "$P/other/.venv/bin/python" ] || python3 -m venv "$P/other/.venv"
    # requirements.txt pins protobuf 3.20.3 and tenacity 6.3.1 for python-etcd3
    "$P/other/.venv/bin/pip" install -q --disable-pip-version-check -r "$P/other/requirements.txt"
fi
if [ -n "${FENCELOCK:-}" ]; then
    FL=$FENCELOCK
else
    (cd "$ROOT" && cargo build --release -q -p fencelock-cli)
    FL="$ROOT/target/release/fencelock"
fi
RS="$P/redis/rust_peers/target/release/rust_peers"
PYR="$P/redis/.venv/bin/python"
PYO="$P/other/.venv/bin/python"

{
    echo "date_utc: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(nproc) cores, $(uname -sr), loadavg $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "fencelock: $FL ($(cd "$ROOT" && git rev-parse --short HEAD))"
    echo "CLIENTS=$CLIENTS BACKENDS=$BACKENDS CYCLES=$CYCLES RUNS=$RUNS"
} >"$OUT/meta.txt"
L1=$(cut -d' ' -f1 /proc/loadavg)
if python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) > 1.5 else 1)' "$L1"; then
    echo "warning: 1-min load average is $L1 on $(nproc) cores; the numbers will be noisy" >&2
fi

ROUND=0
run() { # backend, clients, label, command… : one JSON line, tagged, into raw.jsonl
    local backend=$1 n=$2 label=$3 out rc=0 t0
    shift 3
    echo "== round $ROUND: $backend N=$n $label: $*" >>"$OUT/stderr.log"
    t0=$(date +%s.%N)
    out=$(timeout "$RUN_TIMEOUT" "$@" 2>>"$OUT/stderr.log") || rc=$?
    printf '%s\n' "$out" | python3 -c '
import json, sys, time
backend, n, label, rc, rnd, t0, out = sys.argv[1:8]
lines = [l for l in sys.stdin if l.startswith("{")]
try:
    r = json.loads(lines[-1])
except (IndexError, ValueError):
    r = {"error": f"no JSON line (exit status {rc}; see stderr.log)"}
r.update(bench_backend=backend, bench_clients=int(n), label=label, round=int(rnd),
         wall_secs=round(time.time() - float(t0), 2))
with open(out, "a") as f:
    f.write(json.dumps(r) + "\n")
if "error" in r:
    msg = r["error"]
else:
    ops, p99, sw, ok = r.get("ops_per_sec") or 0, r.get("p99_ms"), r.get("owner_switches"), r.get("correct")
    msg = f"{ops:,.0f} ops/s, p99 {p99} ms, switches {sw}, correct {ok}"
secs = r["wall_secs"]
print(f"  {backend} N={n} {label}: {msg} ({secs} s)", file=sys.stderr)
' "$backend" "$n" "$label" "$rc" "$ROUND" "$t0" "$OUT/raw.jsonl"
}

other() { # backend, clients, label, system of other/bench.py
    run "$1" "$2" "$3" "$PYO" "$P/other/bench.py" --system "$4" --scenario contended \
        --workers "$2" --total "$CYCLES" --deadline "$DEADLINE"
}

for ((ROUND = 1; ROUND <= RUNS; ROUND++)); do
    echo "round $ROUND/$RUNS" >&2
    for b in $BACKENDS; do
        url=$(url_of "$b")
        for n in $CLIENTS; do
            run "$b" "$n" fencelock "$FL" bench --backend "$url" --scenario contended \
                --processes "$n" --workers "$n" --cycles "$CYCLES" --json
            case $b in
                redis)
                    run "$b" "$n" "rslock x1" "$RS" --system rslock --instances 1 --scenario contended \
                        --workers "$n" --ops "$CYCLES" --counter local
                    run "$b" "$n" "redis-py Lock" "$PYR" "$P/redis/py_peers/bench.py" --scenario contended \
                        --workers "$n" --ops "$CYCLES" --counter local
                    run "$b" "$n" "node-redlock x1" node "$P/redis/node_peers/bench.mjs" --scenario contended \
                        --instances 1 --workers "$n" --ops "$CYCLES" --counter local
                    run "$b" "$n" "fair ring (floor)" "$P/redis/rust_peers/target/release/ring" \
                        --workers "$n" --ops $((CYCLES - CYCLES % n))
                    ;;
                redlock)
                    run "$b" "$n" "rslock x5" "$RS" --system rslock --instances 5 --scenario contended \
                        --workers "$n" --ops "$CYCLES" --counter local
                    run "$b" "$n" "node-redlock x5" node "$P/redis/node_peers/bench.mjs" --scenario contended \
                        --instances 5 --workers "$n" --ops "$CYCLES" --counter local
                    ;;
                zookeeper) other "$b" "$n" "kazoo Lock" zookeeper ;;
                etcd)
                    other "$b" "$n" "python-etcd3 Lock" etcd
                    other "$b" "$n" "etcd lock RPC" etcd-v3lock
                    ;;
                postgres-lease) other "$b" "$n" "psycopg lease table" postgres-lease ;;
                postgres-advisory) other "$b" "$n" "psycopg pg_advisory_lock" postgres-advisory ;;
                mariadb-lease | mariadb-getlock) other "$b" "$n" "PyMySQL GET_LOCK" mariadb ;;
                memcached) other "$b" "$n" "pymemcache add/delete" memcached ;;
            esac
        done
    done
done

python3 - "$OUT/raw.jsonl" "$CYCLES" "$BACKENDS" "$CLIENTS" <<'PY' | tee "$OUT/table.md"
import json, sys
from collections import defaultdict
raw, cycles, backends, clients = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), [int(n) for n in sys.argv[4].split()]
runs = defaultdict(list)
labels = defaultdict(list)  # (backend, n) -> labels in run order
for line in open(raw):
    r = json.loads(line)
    k = (r["bench_backend"], r["bench_clients"])
    if r["label"] not in labels[k]:
        labels[k].append(r["label"])
    runs[k + (r["label"],)].append(r)

def fmt(v, spec=",.0f"):
    return "–" if v is None else format(v, spec)

med = {}
print("| backend | clients | system | ops/s (median; runs) | p50 wait ms | p99 wait ms | owner switches / cycles | correct |")
print("|---|---|---|---|---|---|---|---|")
for b in backends:
    for n in clients:
        for label in labels.get((b, n), []):
            rs = runs[(b, n, label)]
            ok = sorted((r for r in rs if "error" not in r), key=lambda r: r.get("ops_per_sec") or 0)
            failed = len(rs) - len(ok)
            if not ok:
                print(f"| {b} | {n} | {label} | failed ({failed} of {len(rs)} runs) | – | – | – | no |")
                continue
            m = ok[len(ok) // 2]
            med[(b, n, label)] = m
            all_ops = ", ".join(fmt(r.get("ops_per_sec")) for r in rs if "error" not in r)
            if failed:
                all_ops += f"; {failed} failed"
            sw = m.get("owner_switches")
            sws = "–" if sw is None else f"{sw} / {cycles} ({100 * sw / cycles:.0f} %)"
            n_ok = sum(1 for r in rs if r.get("correct") is True)
            corr = "yes" if n_ok == len(rs) else f"no ({n_ok} of {len(rs)} runs correct)"
            print(f"| {b} | {n} | {label} | {fmt(m.get('ops_per_sec'))} ({all_ops}) | "
                  f"{fmt(m.get('p50_ms'), '.3f')} | {fmt(m.get('p99_ms'), '.3f')} | {sws} | {corr} |")
print()
for b in backends:
    for n in clients:
        f = med.get((b, n, "fencelock"))
        peers = [(l, r) for (bb, nn, l), r in med.items()
                 if (bb, nn) == (b, n) and l != "fencelock" and "floor" not in l]
        good = [p for p in peers if p[1].get("correct") is True] or peers
        if not f or not good:
            print(f"- {b}, {n} clients: no comparison (fencelock or every peer failed)")
            continue
        pl, p = max(good, key=lambda p: p[1].get("ops_per_sec") or 0)
        ratio = (f.get("ops_per_sec") or 0) / p["ops_per_sec"] if p.get("ops_per_sec") else float("nan")
        p99 = f"{f['p99_ms'] / p['p99_ms']:.3f}" if p.get("p99_ms") else "–"
        sw = f.get("owner_switches")
        met = "met" if sw is not None and sw >= 0.9 * cycles else "not met"
        print(f"- {b}, {n} clients: fencelock {ratio:.2f}× the ops/s of the fastest peer ({pl}), "
              f"p99 wait {p99} of its p99; fencelock owner switches {sw} of {cycles} cycles "
              f"(≥ 90 %: {met})")
print()
print(f"Notes: {cycles} cycles per run; median run by ops/s of each case, all runs in brackets. "
      "fencelock: `bench --scenario contended --processes N --workers N` = N OS processes of one "
      "task each, the counter a file read and written back in place under the lock, the merged history checked. "
      "Redis/Redlock peers (rslock, redis-py, node-redlock; library default retry delays): N tasks/threads "
      "of one process, each its own client and connections (patched), the in-process counter "
      "(`--counter local`: load, yield, store under the lock). Other peers (other/bench.py): N threads "
      "of one Python process, each its own client/session/connection, the counter a file as fencelock's. "
      "The fair ring (floor): N processes pass one token around through Redis (BLPOP/RPUSH), "
      "the least a lock that hands every cycle to another process must do; not a lock. "
      "Both mariadb rows use the PyMySQL GET_LOCK peer (over the unix socket; fencelock over TCP); the "
      "python peers run under the GIL. p50/p99 = acquire wait from the first attempt to the grant; "
      "owner switches = consecutive grants that went to a different worker (at most cycles − 1).")
PY
echo "results in $OUT" >&2
