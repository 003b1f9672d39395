#!/usr/bin/env bash
# The uncontended cycle (acquire + release, one client) of fencelock beside the C
# floor of its server: `redis-benchmark -c 1 -t set` (two SETs a cycle), `pgbench`
# on a bare `pg_advisory_lock` / `pg_advisory_unlock` script, `mysqlslap` on a bare
# `GET_LOCK` / `RELEASE_LOCK` pair. Rounds interleave every case; the median of
# each is kept. Beside ops/s it reports the client's CPU per cycle (user + system,
# from the child's rusage) and, on Redis, the server's time per cycle (INFO
# commandstats: the SETs of the floor, fencelock's EVALSHAs with what they call).
#
# Usage: scripts/bench/uncontended-floor.sh [OUT_DIR]
# env: RUNS (3), REDIS (redis://127.0.0.1:6379), PG (postgres://postgres:postgres@
#      127.0.0.1:5432/test), MARIADB (mysql://root@127.0.0.1:3306/test),
#      CYCLES (10000 per fencelock run), FL (a fencelock binary; default: build
#      the release CLI with its default features)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT=${1:-/tmp/fencelock-floor-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
if [ -z "${FL:-}" ]; then
    (cd "$ROOT" && cargo build --release -q -p fencelock-cli)
    FL="$ROOT/target/release/fencelock"
fi
export FL OUT
export RUNS=${RUNS:-3} CYCLES=${CYCLES:-10000}
export REDIS=${REDIS:-redis://127.0.0.1:6379}
export PG=${PG:-postgres://postgres:postgres@127.0.0.1:5432/test}
export MARIADB=${MARIADB:-mysql://root@127.0.0.1:3306/test}

python3 - <<'PY' | tee "$OUT/table.md"
import json, os, re, resource, subprocess, sys, time
from urllib.parse import urlparse

FL, OUT = os.environ["FL"], os.environ["OUT"]
RUNS, CYCLES = int(os.environ["RUNS"]), int(os.environ["CYCLES"])
R, PG, M = (urlparse(os.environ[k]) for k in ("REDIS", "PG", "MARIADB"))
redis_cli = ["redis-cli", "-h", R.hostname, "-p", str(R.port or 6379)]

def run(cmd, env=None):
    """Runs cmd; returns its stdout and the CPU seconds (user + system) it used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        sys.exit(f"{cmd[0]} failed ({p.returncode}): {p.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return p.stdout, cpu

def redis_usec(command):
    """Server µs spent in `command` since the last reset (INFO commandstats)."""
    out = subprocess.run(redis_cli + ["info", "commandstats"], capture_output=True, text=True).stdout
    m = re.search(rf"cmdstat_{command}:calls=(\d+),usec=(\d+)", out)
    return int(m.group(2)) if m else 0

def reset_redis_stats():
    subprocess.run(redis_cli + ["config", "resetstat"], capture_output=True, check=True)

def fencelock(url):
    out, cpu = run([FL, "bench", "--backend", url, "--scenario", "uncontended",
                    "--cycles", str(CYCLES), "--json"])
    r = json.loads([l for l in out.splitlines() if l.startswith("{")][-1])
    return r["ops_per_sec"], cpu / CYCLES

def redis_floor():
    n = 100000
    out, cpu = run(["redis-benchmark", "-h", R.hostname, "-p", str(R.port or 6379),
                    "-c", "1", "-n", str(n), "-t", "set", "--csv"])
    rps = float(out.strip().splitlines()[-1].split(",")[1].strip('"'))
    return rps / 2, cpu / (n / 2)

def pgbench(name, sql):
    script = os.path.join(OUT, name)
    with open(script, "w") as f:
        f.write(sql)
    env = dict(os.environ, PGPASSWORD=PG.password or "")
    out, cpu = run(["pgbench", "-h", PG.hostname, "-p", str(PG.port or 5432), "-U", PG.username,
                    "-n", "-M", "prepared", "-f", script, "-c", "1", "-t", str(CYCLES),
                    PG.path.lstrip("/")], env)
    tps = float(re.search(r"tps = ([\d.]+)", out).group(1))
    return tps, cpu / CYCLES

def mysqlslap(query):
    out, cpu = run(["mysqlslap", "-h", M.hostname, "-P", str(M.port or 3306), "-u", M.username,
                    f"--password={M.password or ''}", f"--create-schema={M.path.lstrip('/')}",
                    "--concurrency=1", "--iterations=1", f"--number-of-queries={2 * CYCLES}",
                    "--delimiter=;", f"--query={query}"])
    secs = float(re.search(r"Average number of seconds to run all queries: ([\d.]+)", out).group(1))
    return CYCLES / secs, cpu / CYCLES

# fencelock's own two statements of a cycle (from the advisory and get_lock
# modes' sources: a try of `fencelock_advisory_take`, `fencelock_advisory_let_go`;
# the one-statement try with token, `RELEASE_LOCK`), sent by the C client: what
# the protocol costs without fencelock's client stack. The fencelock runs before
# create the functions and tables.
PG_OWN = ("SELECT fencelock_advisory_take('floor', 'o', false, -1, 30000);\n"
          "SELECT fencelock_advisory_let_go('floor', false, 0);\n")
NAME = "IF(CHAR_LENGTH('floor') <= 64, 'floor', SHA2('floor', 256))"
M_OWN = ("INSERT INTO fencelock_getlock (lock_key, fence, holder, conn_id) "
         "SELECT 'floor', LAST_INSERT_ID(CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED)), 'o', "
         f"CONNECTION_ID() FROM DUAL WHERE IF(GET_LOCK({NAME}, 0) = 1, "
         "(SELECT COALESCE(MAX(permits), 0) FROM fencelock_semaphores WHERE lock_key = 'floor' "
         "LOCK IN SHARE MODE), -1) = 0 ON DUPLICATE KEY UPDATE "
         "fence = LAST_INSERT_ID(GREATEST(fence + 1, VALUES(fence))), holder = VALUES(holder), "
         f"conn_id = VALUES(conn_id);SELECT RELEASE_LOCK({NAME})")

cases = [
    ("redis", "floor: redis-benchmark -c 1 -t set ÷ 2", redis_floor, "set"),
    ("redis", "fencelock", lambda: fencelock(os.environ["REDIS"]), "evalsha"),
    ("postgres", "fencelock ?mode=advisory", lambda: fencelock(os.environ["PG"] + "?mode=advisory"), None),
    ("postgres", "floor: pgbench, bare advisory lock/unlock",
     lambda: pgbench("bare.sql", "SELECT pg_advisory_lock(42);\nSELECT pg_advisory_unlock(42);\n"), None),
    ("postgres", "pgbench, fencelock's two statements", lambda: pgbench("own.sql", PG_OWN), None),
    ("mariadb", "fencelock ?mode=get_lock", lambda: fencelock(os.environ["MARIADB"] + "?mode=get_lock"), None),
    ("mariadb", "floor: mysqlslap, bare GET_LOCK/RELEASE_LOCK",
     lambda: mysqlslap("SELECT GET_LOCK('floor', 10);SELECT RELEASE_LOCK('floor')"), None),
    ("mariadb", "mysqlslap, fencelock's two statements", lambda: mysqlslap(M_OWN), None),
]
results = {c[1]: [] for c in cases}
for i in range(RUNS):
    print(f"round {i + 1}/{RUNS}", file=sys.stderr)
    for server, label, f, stat in cases:
        if stat:
            reset_redis_stats()
        ops, cpu = f()
        server_us = None
        if stat:  # a floor cycle is two of redis_floor's 100,000 SETs
            server_us = redis_usec(stat) / (50000 if stat == "set" else CYCLES)
        results[label].append((ops, cpu * 1e6, server_us))
        time.sleep(1)

with open(os.path.join(OUT, "raw.json"), "w") as f:
    json.dump(results, f)
print("| server | what | cycles/s (runs) | median | of the floor | client CPU µs/cycle | server µs/cycle |")
print("|---|---|---|---|---|---|---|")
def median(label):
    rs = sorted(results[label])
    return rs[len(rs) // 2]
floor = {server: median(label)[0] for server, label, _, _ in cases if label.startswith("floor")}
for server, label, _, _ in sorted(cases, key=lambda c: (c[0] != "redis", c[0], not c[1].startswith("floor"))):
    med = median(label)
    ratio = med[0] / floor[server]
    srv = f"{med[2]:.1f}" if med[2] is not None else "–"
    runs = " / ".join(f"{r[0]:,.0f}" for r in results[label])
    print(f"| {server} | {label} | {runs} | {med[0]:,.0f} | {ratio:.2f} | {med[1]:.1f} | {srv} |")
# Redis: the C client's cycle with fencelock's server time in place of two SETs'
# (the floor's time per cycle, less its server time, plus fencelock's).
f, fl = median("floor: redis-benchmark -c 1 -t set ÷ 2"), median("fencelock")
own = 1e6 / (1e6 / f[0] - f[2] + fl[2])
print(f"| redis | derived: the floor's cycle with fencelock's server time | – | {own:,.0f} | {own / f[0]:.2f} | – | {fl[2]:.1f} |")
PY
echo "results in $OUT" >&2
