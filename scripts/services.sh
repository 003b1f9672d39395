#!/usr/bin/env bash
# Starts every server the tests need on loopback (DESIGN §7), installing a missing
# one from Debian packages. Idempotent: a service that already answers is left
# alone. `scripts/services.sh stop` stops what this script started.
#
# Today's backends (memory, SQLite) need no server; each backend issue adds its
# own `start_<service>` function and a line in `main` below.
set -euo pipefail

STATE_DIR=${FENCELOCK_SERVICES_DIR:-/tmp/fencelock-services}
mkdir -p "$STATE_DIR"

apt_updated=0
# ensure_pkg PACKAGE COMMAND: installs PACKAGE unless COMMAND is on the PATH.
ensure_pkg() {
    local pkg=$1 cmd=$2
    command -v "$cmd" >/dev/null 2>&1 && return 0
    if [ "$apt_updated" = 0 ]; then
        apt-get update -qq
        apt_updated=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$pkg" >/dev/null
}

# port_open PORT: true if something accepts TCP on 127.0.0.1:PORT.
port_open() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# wait_port NAME PORT [SECONDS]: waits until PORT answers, or fails naming NAME.
wait_port() {
    local name=$1 port=$2 secs=${3:-30} i
    for ((i = 0; i < secs * 10; i++)); do
        port_open "$port" && return 0
        sleep 0.1
    done
    echo "services: $name did not start on 127.0.0.1:$port within ${secs}s" >&2
    return 1
}

# say SERVICE ADDRESS STATUS: the one line per service.
say() { printf '%-22s %-32s %s\n' "$1" "$2" "$3"; }

stop_all() {
    local f
    for f in "$STATE_DIR"/*.pid; do
        [ -e "$f" ] || continue
        kill "$(cat "$f")" 2>/dev/null || true
        rm -f "$f"
    done
    echo "services: stopped what services.sh started"
}

main() {
    if [ "${1:-}" = stop ]; then
        stop_all
        return
    fi
    say "sqlite (embedded)" "file" "no server needed"
    say "memory" "in process" "no server needed"
}

main "$@"
