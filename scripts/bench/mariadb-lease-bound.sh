#!/usr/bin/env bash
# What bounds the MariaDB lease cycle: one client alone (`--scenario uncontended`)
# and 4 processes (`--scenario contended --processes 4 --workers 4`), each with
# InnoDB flushing its log at every commit (`innodb_flush_log_at_trx_commit=1`,
# the setting lease mode's guarantee needs) and once a second (`=2`, for the
# measurement only). Rounds interleave every case; the median of each is kept.
# Then one uncontended run at `=1` with the slow query log at a 0 threshold:
# the server's time per statement of a cycle (medians).
#
# The script changes the server's global settings for the run and restores them
# on exit (even on failure); do not run it against a server others use.
#
# Usage: scripts/bench/mariadb-lease-bound.sh [OUT_DIR]
# env: RUNS (3), MYSQL (mysql client command: "mysql -uroot -h127.0.0.1 -P3306"),
#      URL (mysql://root@127.0.0.1:3306/test?mode=lease), FL (a fencelock binary;
#      default: build the release CLI)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT=${1:-/tmp/fencelock-mariadb-lease-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
if [ -z "${FL:-}" ]; then
    (cd "$ROOT" && cargo build --release -q -p fencelock-cli)
    FL="$ROOT/target/release/fencelock"
fi
export FL OUT RUNS=${RUNS:-3}
export URL=${URL:-"mysql://root@127.0.0.1:3306/test?mode=lease"}
export MYSQL=${MYSQL:-"mysql -uroot -h127.0.0.1 -P3306"}
# The server's log goes where its own user can write.
export SLOW_LOG=/tmp/fencelock-lease-slow-$$.log

read -r FLUSH0 SLOW0 LQT0 FILE0 < <($MYSQL -N -e \
    "SELECT @@innodb_flush_log_at_trx_commit, @@slow_query_log, @@long_query_time, @@slow_query_log_file")
restore() {
    $MYSQL -e "SET GLOBAL innodb_flush_log_at_trx_commit=$FLUSH0; SET GLOBAL slow_query_log=$SLOW0;
               SET GLOBAL long_query_time=$LQT0; SET GLOBAL slow_query_log_file='$FILE0'"
}
trap 'restore; rm -f "$SLOW_LOG"' EXIT

python3 - <<'PY' | tee "$OUT/table.md"
import collections, json, os, re, shlex, subprocess, sys

FL, OUT, URL = os.environ["FL"], os.environ["OUT"], os.environ["URL"]
RUNS, MYSQL, SLOW_LOG = int(os.environ["RUNS"]), shlex.split(os.environ["MYSQL"]), os.environ["SLOW_LOG"]

def sql(statement):
    subprocess.run(MYSQL + ["-e", statement], check=True)

def bench(args):
    p = subprocess.run([FL, "bench", "--backend", URL, "--json", *args], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"fencelock bench failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads([l for l in p.stdout.splitlines() if l.startswith("{")][-1])

cases = [
    ("1 client (uncontended)", ["--scenario", "uncontended", "--cycles", "3000"]),
    ("4 processes (contended)", ["--scenario", "contended", "--cycles", "1000", "--processes", "4", "--workers", "4"]),
]
results = collections.defaultdict(list)
with open(f"{OUT}/raw.jsonl", "w") as raw:
    for _ in range(RUNS):
        for name, args in cases:
            for flush in (1, 2):
                sql(f"SET GLOBAL innodb_flush_log_at_trx_commit={flush}")
                r = bench(args)
                raw.write(json.dumps({"case": name, "flush": flush, **r}) + "\n")
                results[(name, flush)].append(r)

print("| clients | innodb_flush_log_at_trx_commit | ops/s (median; runs) | p50 acquire ms | p99 acquire ms | owner switches |")
print("|---|---|---|---|---|---|")
for name, _ in cases:
    for flush in (1, 2):
        rs = sorted(results[(name, flush)], key=lambda r: r["ops_per_sec"])
        m = rs[len(rs) // 2]
        runs = ", ".join(f"{r['ops_per_sec']:,.0f}" for r in results[(name, flush)])
        sw = m.get("owner_switches")
        print(f"| {name} | {flush} | {m['ops_per_sec']:,.0f} ({runs}) | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | {'–' if sw is None else sw} |")

# The server's time per statement of an uncontended cycle, at =1.
sql("SET GLOBAL innodb_flush_log_at_trx_commit=1")
sql(f"SET GLOBAL slow_query_log_file='{SLOW_LOG}'; SET GLOBAL long_query_time=0; SET GLOBAL slow_query_log=1")
bench(["--scenario", "uncontended", "--cycles", "1000"])
sql("SET GLOBAL slow_query_log=0")
times, qt = collections.defaultdict(list), None
with open(SLOW_LOG) as f:
    for line in f:
        m = re.match(r"# Query_time: ([\d.]+)", line)
        if m:
            qt = float(m.group(1))
        elif qt is not None and line.strip() and not line.startswith(("#", "SET timestamp", "use ")):
            words = line.split()
            times[" ".join(words[:3])].append(qt)
            qt = None
print()
print("| statement (first words) | calls | server µs (median) |")
print("|---|---|---|")
for stmt, v in sorted(times.items(), key=lambda kv: -sum(kv[1])):
    if len(v) < 500:
        continue
    v.sort()
    print(f"| `{stmt}` | {len(v)} | {v[len(v) // 2] * 1e6:.0f} |")
PY
