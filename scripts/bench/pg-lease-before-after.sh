#!/usr/bin/env bash
# Interleaved before/after of one change: `fencelock bench --scenario contended
# --processes N --workers N` on the PostgreSQL lease table, 3 rounds of N = 2, 4,
# 8, 16, each round running both binaries. /tmp/fencelock-old and
# /tmp/fencelock-new are release builds of the two commits; each runs in a
# database of its own (flold, flnew: create them first), since each version
# installs its own functions when it connects.
# Usage: scripts/bench/pg-lease-before-after.sh [OUT.jsonl]
set -u
OUT=${1:-/tmp/oldnew.jsonl}
: > "$OUT"
for r in 1 2 3; do
  for n in 2 4 8 16; do
    for v in old new; do
      line=$(timeout 300 /tmp/fencelock-$v bench --backend "postgres://postgres:postgres@127.0.0.1:5432/fl$v?mode=lease" \
        --scenario contended --processes $n --workers $n --cycles 1000 --json 2>/dev/null | grep '^{' | tail -1)
      echo "{\"v\":\"$v\",\"n\":$n,\"r\":$r,\"res\":$line}" >> "$OUT"
      echo "$v n=$n r=$r $(echo "$line" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("ops_per_sec"), d.get("p50_ms"), d.get("p99_ms"), d.get("owner_switches"), d.get("correct"))')"
    done
  done
done
