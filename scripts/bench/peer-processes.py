#!/usr/bin/env python3
"""A peer of ../shared/peers/other/bench.py, run as N OS processes instead of N
threads of one process: the shape of `fencelock bench --processes N --workers N`.

Each process opens its own client (the peer's `worker()`), waits at a common
start, then runs its share of the cycles: acquire (timed from the call to the
grant), the read-modify-write of the counter file, one line with its index
appended to an order file (inside the critical section, so in grant order),
release. Prints one JSON line like bench.py's (ops/s, p50/p99 acquire wait,
owner switches, correct).

Two systems besides bench.py's own drive fencelock's SQL from the peer's client,
to tell the statements' cost from the client's:
  postgres-advisory-fl  fencelock_advisory_take / fencelock_advisory_let_go
                        (the functions fencelock creates; run a fencelock
                        `?mode=advisory` bench once first)
  mariadb-fl            GET_LOCK, then fencelock's token statement, then
                        RELEASE_LOCK (the tables fencelock creates)

Usage: peer-processes.py BENCH_PY SYSTEM N [CYCLES] (CYCLES 1000)
"""
import importlib.util
import json
import multiprocessing as mp
import os
import sys
import time
import uuid


def load(path):
    spec = importlib.util.spec_from_file_location("peer_bench", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def extra_peers(b):
    class PgAdvisoryFl:
        name = "postgres-advisory-fl"
        impl = "psycopg3 calling fencelock_advisory_take / fencelock_advisory_let_go"

        def setup(self):
            pass

        def worker(self):
            import psycopg

            class W:
                def __init__(self):
                    self.c = psycopg.connect(b.PG_DSN, autocommit=True)
                    self.o = "peer-" + uuid.uuid4().hex

                def acquire(self):
                    t = self.c.execute(
                        "SELECT fencelock_advisory_take(%s, %s, false, 0, 30000)", (b.KEY, self.o)
                    ).fetchone()[0]
                    assert t is not None and t > 0, t

                def release(self):
                    return self.c.execute(
                        "SELECT fencelock_advisory_let_go(%s, false, 0)", (b.KEY,)
                    ).fetchone()[0]

                def close(self):
                    self.c.close()

            return W()

    class MariaFl(b.MariaGetLock):
        name = "mariadb-fl"
        impl = "PyMySQL GET_LOCK(name, 30), fencelock's token INSERT, RELEASE_LOCK (unix socket)"

        def worker(self):
            conn = self._conn()
            key = b.KEY

            class W:
                def __init__(self):
                    self.c = conn
                    self.o = ("peer-" + uuid.uuid4().hex).encode()

                def acquire(self):
                    with self.c.cursor() as cur:
                        cur.execute("SELECT GET_LOCK(%s, 30)", (key,))
                        assert cur.fetchone()[0] == 1
                        cur.execute(
                            "INSERT INTO fencelock_getlock (lock_key, fence, holder, conn_id) "
                            "SELECT %s, LAST_INSERT_ID(CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED)), "
                            "%s, CONNECTION_ID() FROM DUAL WHERE (SELECT COALESCE(MAX(permits), 0) "
                            "FROM fencelock_semaphores WHERE lock_key = %s LOCK IN SHARE MODE) = 0 "
                            "ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(GREATEST(fence + 1, VALUES(fence))), "
                            "holder = VALUES(holder), conn_id = VALUES(conn_id)",
                            (key.encode(), self.o, key.encode()),
                        )

                def release(self):
                    with self.c.cursor() as cur:
                        cur.execute("SELECT RELEASE_LOCK(%s)", (key,))
                        return cur.fetchone()[0] == 1

                def close(self):
                    self.c.close()

            return W()

    return {"postgres-advisory-fl": PgAdvisoryFl, "mariadb-fl": MariaFl}


def body(bench_py, system, i, cycles, start, cpath, opath, out):
    b = load(bench_py)
    peers = dict(b.PEERS, **extra_peers(b))
    w = peers[system]().worker()
    waits, err = [], None
    start.wait()
    try:
        for _ in range(cycles):
            s = time.perf_counter()
            w.acquire()
            waits.append(time.perf_counter() - s)
            b.rmw(cpath)
            with open(opath, "a") as f:
                f.write("%d\n" % i)
            if not w.release():
                err = "release reported failure"
                break
    except Exception as e:  # noqa
        err = repr(e)
    out.put((waits, err))
    w.close()


def main():
    bench_py, system, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    total = int(sys.argv[4]) if len(sys.argv) > 4 else 1000
    b = load(bench_py)
    peers = dict(b.PEERS, **extra_peers(b))
    peers[system]().setup()
    cpath = b.counter_path(system + "-processes")
    opath = cpath + ".order"
    with open(cpath, "w") as f:
        f.write("0")
    open(opath, "w").close()
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(n + 1), ctx.Queue()
    per = [total // n + (1 if i < total % n else 0) for i in range(n)]
    ps = [ctx.Process(target=body, args=(bench_py, system, i, per[i], start, cpath, opath, out)) for i in range(n)]
    [p.start() for p in ps]
    start.wait()
    t0 = time.perf_counter()
    res = [out.get() for _ in ps]
    secs = time.perf_counter() - t0
    [p.join() for p in ps]
    lat = sorted(x for waits, _ in res for x in waits)
    errs = [e for _, e in res if e]
    order = open(opath).read().split()
    final = int(open(cpath).read() or 0)
    pct = lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 3) if lat else None  # noqa
    print(json.dumps({
        "system": system + " (processes)",
        "scenario": "contended",
        "workers": n,
        "ops": len(lat),
        "secs": round(secs, 3),
        "ops_per_sec": round(len(lat) / secs, 1),
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "owner_switches": sum(1 for j in range(1, len(order)) if order[j] != order[j - 1]),
        "final_counter": final,
        "expected_counter": total,
        "correct": final == total and not errs,
        "errors": errs[:3],
    }))


if __name__ == "__main__":
    main()
