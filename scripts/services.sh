#!/usr/bin/env bash
# Starts every server the tests need on loopback (ARCHITECTURE.md §7), installing a missing
# one from Debian packages. Idempotent: a service that already answers is left
# alone. `scripts/services.sh stop` stops what this script started.
#
# Each backend adds its own `start_<service>` function and a line in `main`.
set -euo pipefail

STATE_DIR=${FENCELOCK_SERVICES_DIR:-/tmp/fencelock-services}
mkdir -p "$STATE_DIR"

apt_updated=0
# ensure_pkg PACKAGE COMMAND|FILE: installs PACKAGE unless COMMAND is on the PATH
# (or FILE exists).
ensure_pkg() {
    local pkg=$1 cmd=$2
    command -v "$cmd" >/dev/null 2>&1 && return 0
    [ -e "$cmd" ] && return 0
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

# start_redis_server PORT [ARGS…]: a throw-away redis-server on loopback, no persistence.
start_redis_server() {
    local port=$1
    shift
    local dir="$STATE_DIR/redis-$port"
    rm -rf "$dir"
    mkdir -p "$dir"
    redis-server --bind 127.0.0.1 --port "$port" --save "" --appendonly no --dir "$dir" \
        --daemonize yes --pidfile "$STATE_DIR/redis-$port.pid" --logfile "$dir/redis.log" "$@"
}

start_redis() {
    ensure_pkg openssl openssl # the TLS tests make their certificates with it
    if port_open 6379; then
        say redis 127.0.0.1:6379 "already running"
        return
    fi
    ensure_pkg redis-server redis-server
    start_redis_server 6379
    wait_port redis 6379
    say redis 127.0.0.1:6379 started
}

start_redlock() {
    ensure_pkg redis-server redis-server
    local port started=0
    for port in 7001 7002 7003 7004 7005; do
        if ! port_open "$port"; then
            start_redis_server "$port"
            wait_port "redlock instance" "$port"
            started=$((started + 1))
        fi
    done
    if [ "$started" = 0 ]; then
        say "redlock instances" "127.0.0.1:7001-7005" "already running"
    else
        say "redlock instances" "127.0.0.1:7001-7005" "started $started"
    fi
}

# A cluster of three primaries (7101-7103) with a replica each (7104-7106).
cluster_ok() {
    local info
    info=$(redis-cli -p 7101 cluster info 2>/dev/null) || return 1
    echo "$info" | grep -q 'cluster_state:ok' && echo "$info" | grep -q 'cluster_known_nodes:6'
}

start_redis_cluster() {
    if cluster_ok; then
        say "redis cluster" "127.0.0.1:7101-7106" "already running"
        return
    fi
    ensure_pkg redis-server redis-server
    ensure_pkg redis-tools redis-cli
    local port
    for port in 7101 7102 7103 7104 7105 7106; do
        redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
    done
    for port in 7101 7102 7103 7104 7105 7106; do
        start_redis_server "$port" --cluster-enabled yes --cluster-config-file nodes.conf \
            --cluster-node-timeout 5000 --repl-diskless-sync-delay 0
        wait_port "redis cluster node" "$port"
    done
    # The first three become the primaries, in order.
    redis-cli --cluster create 127.0.0.1:7101 127.0.0.1:7102 127.0.0.1:7103 \
        127.0.0.1:7104 127.0.0.1:7105 127.0.0.1:7106 \
        --cluster-replicas 1 --cluster-yes >"$STATE_DIR/redis-cluster-create.log" 2>&1
    local i
    for ((i = 0; i < 100; i++)); do
        cluster_ok && break
        sleep 0.1
    done
    cluster_ok || { echo "services: redis cluster did not reach cluster_state:ok" >&2; return 1; }
    say "redis cluster" "127.0.0.1:7101-7106" "started (3 primaries, 3 replicas)"
}

# A master (7201) with two replicas (7202, 7203) and three Sentinels
# (7211-7213) monitoring it as the service `fencelock`.
sentinel_ok() {
    local port
    port=$(redis-cli -p 7211 sentinel get-master-addr-by-name fencelock 2>/dev/null | sed -n 2p)
    [ -n "$port" ] && redis-cli -p "$port" role 2>/dev/null | head -1 | grep -q master &&
        port_open 7212 && port_open 7213
}

start_redis_sentinel() {
    ensure_pkg redis-server redis-server
    ensure_pkg redis-sentinel redis-sentinel
    if sentinel_ok; then
        say "redis sentinel" "127.0.0.1:7211-7213" "already running"
        return
    fi
    local port dir i
    for port in 7201 7202 7203 7211 7212 7213; do
        redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
    done
    start_redis_server 7201 --repl-diskless-sync-delay 0
    for port in 7202 7203; do
        start_redis_server "$port" --repl-diskless-sync-delay 0 --replicaof 127.0.0.1 7201
    done
    for port in 7211 7212 7213; do
        dir="$STATE_DIR/sentinel-$port"
        rm -rf "$dir"
        mkdir -p "$dir"
        printf '%s\n' "port $port" "bind 127.0.0.1" "dir $dir" "daemonize yes" \
            "pidfile $STATE_DIR/sentinel-$port.pid" "logfile $dir/sentinel.log" \
            "sentinel monitor fencelock 127.0.0.1 7201 2" \
            "sentinel down-after-milliseconds fencelock 5000" \
            "sentinel failover-timeout fencelock 30000" >"$dir/sentinel.conf"
        redis-sentinel "$dir/sentinel.conf"
        wait_port "redis sentinel" "$port"
    done
    for ((i = 0; i < 100; i++)); do
        sentinel_ok && break
        sleep 0.1
    done
    sentinel_ok || { echo "services: the Sentinels do not name a master" >&2; return 1; }
    say "redis sentinel" "127.0.0.1:7211-7213" "started (master 7201, replicas 7202-7203)"
}

ZK_CLASSPATH="/etc/zookeeper/conf_example:/usr/share/java/zookeeper.jar"

# zk_server DIR CLIENT_PORT [MYID SERVERS…]: one ZooKeeper server (Debian's jar)
# with a short tick (sessions from 1 s) and quick container cleanup.
zk_server() {
    local dir=$1 port=$2 myid=${3:-} s
    shift 3 2>/dev/null || shift $#
    rm -rf "$dir"
    mkdir -p "$dir/data"
    {
        echo "tickTime=500"
        echo "initLimit=20"
        echo "syncLimit=10"
        echo "dataDir=$dir/data"
        echo "clientPort=$port"
        echo "clientPortAddress=127.0.0.1"
        echo "maxSessionTimeout=60000"
        echo "admin.enableServer=false"
        echo "4lw.commands.whitelist=*"
        for s in "$@"; do echo "$s"; done
    } >"$dir/zoo.cfg"
    [ -n "$myid" ] && echo "$myid" >"$dir/data/myid"
    nohup java -cp "$ZK_CLASSPATH" -Dzookeeper.log.dir="$dir" -Dznode.container.checkIntervalMs=500 \
        org.apache.zookeeper.server.quorum.QuorumPeerMain "$dir/zoo.cfg" >"$dir/server.log" 2>&1 &
    echo $! >"$STATE_DIR/zookeeper-$port.pid"
}

# zk_ok PORT: the server answers and serves requests.
zk_ok() {
    local out
    out=$( (exec 3<>"/dev/tcp/127.0.0.1/$1" && echo srvr >&3 && timeout 2 cat <&3) 2>/dev/null) || return 1
    echo "$out" | grep -q 'Mode: \(standalone\|leader\|follower\)'
}

wait_zk() {
    local name=$1 port=$2 i
    for ((i = 0; i < 600; i++)); do
        zk_ok "$port" && return 0
        sleep 0.1
    done
    echo "services: $name did not serve on 127.0.0.1:$port within 60s" >&2
    return 1
}

start_zookeeper() {
    ensure_pkg default-jre-headless java
    ensure_pkg zookeeper /usr/share/java/zookeeper.jar
    if zk_ok 2181; then
        say zookeeper 127.0.0.1:2181 "already running"
    else
        zk_server "$STATE_DIR/zookeeper-2181" 2181
        wait_zk zookeeper 2181
        say zookeeper 127.0.0.1:2181 started
    fi
    if zk_ok 2281 && zk_ok 2282 && zk_ok 2283; then
        say "zookeeper ensemble" "127.0.0.1:2281-2283" "already running"
        return
    fi
    local i peers=()
    for i in 1 2 3; do
        peers+=("server.$i=127.0.0.1:229$i:239$i")
    done
    for i in 1 2 3; do
        if [ -f "$STATE_DIR/zookeeper-228$i.pid" ]; then
            kill "$(cat "$STATE_DIR/zookeeper-228$i.pid")" 2>/dev/null || true
        fi
    done
    for i in 1 2 3; do
        zk_server "$STATE_DIR/zookeeper-228$i" "228$i" "$i" "${peers[@]}"
    done
    for i in 1 2 3; do
        wait_zk "zookeeper ensemble member" "228$i"
    done
    say "zookeeper ensemble" "127.0.0.1:2281-2283" started
}

# Python clients the interop tests drive (pinned): kazurator, a port of
# Curator's recipes.
# PostgreSQL (Debian's cluster tools): the `test` database, password login for
# `postgres` over TCP, room for the tests' many sessions.
pg_sql() { runuser -u postgres -- psql -X -q -v ON_ERROR_STOP=1 -tA "$@"; }
start_postgres() {
    ensure_pkg postgresql pg_ctlcluster
    local ver status=started
    ver=$(ls /usr/lib/postgresql | sort -V | tail -1)
    if port_open 5432; then
        status="already running"
    else
        pg_lsclusters -h | awk '{print $1" "$2}' | grep -qx "$ver main" || pg_createcluster "$ver" main >/dev/null
        pg_ctlcluster "$ver" main start
        wait_port postgresql 5432
    fi
    if [ "$(pg_sql -c 'SHOW max_connections')" -lt 300 ]; then
        pg_sql -c 'ALTER SYSTEM SET max_connections = 300'
        pg_ctlcluster "$ver" main restart
        wait_port postgresql 5432
        status=restarted
    fi
    pg_sql -c "ALTER USER postgres PASSWORD 'postgres'"
    pg_sql -c "SELECT 1 FROM pg_database WHERE datname = 'test'" | grep -q 1 || pg_sql -c 'CREATE DATABASE test'
    # Advisory mode grants nothing after a restart until the server has been
    # up for the longest TTL of the holds granted before it (a holder cut off
    # from the server could not hear of it). No holder from before a test run
    # lives: forget them (the tables are made again on first use).
    pg_sql -d test -c 'DROP TABLE IF EXISTS fencelock_restart_gate, fencelock_session_ttl'
    say postgresql 127.0.0.1:5432 "$status"
}

# MariaDB: the `test` database and root with an empty password over TCP.
start_mariadb() {
    ensure_pkg mariadb-server mariadbd
    local status=started
    if port_open 3306; then
        status="already running"
    else
        service mariadb start >/dev/null 2>&1 || {
            mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
            (mysqld_safe >/dev/null 2>&1 &)
        }
        wait_port mariadb 3306
    fi
    mariadb -u root <<'SQL'
ALTER USER 'root'@'localhost' IDENTIFIED VIA mysql_native_password USING PASSWORD('') OR unix_socket;
CREATE USER IF NOT EXISTS 'root'@'127.0.0.1' IDENTIFIED BY '';
GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;
CREATE DATABASE IF NOT EXISTS test;
SET GLOBAL max_connections = 500;
SQL
    # As for PostgreSQL: get_lock mode's restart gate.
    mariadb -u root -e 'DROP TABLE IF EXISTS test.fencelock_restart_gate, test.fencelock_session_ttl'
    say mariadb 127.0.0.1:3306 "$status"
}

# etcd_member NAME CLIENT_PORT PEER_PORT CLUSTER TOKEN: one etcd member on
# loopback, started from an empty data directory (TOKEN: the same for every
# member of one cluster).
etcd_member() {
    local name=$1 cport=$2 pport=$3 cluster=$4 token=$5 dir="$STATE_DIR/etcd-$1"
    rm -rf "$dir"
    mkdir -p "$dir"
    nohup etcd --name "$name" --data-dir "$dir/data" \
        --listen-client-urls "http://127.0.0.1:$cport" --advertise-client-urls "http://127.0.0.1:$cport" \
        --listen-peer-urls "http://127.0.0.1:$pport" --initial-advertise-peer-urls "http://127.0.0.1:$pport" \
        --initial-cluster "$cluster" --initial-cluster-state new --initial-cluster-token "$token" \
        >"$dir/etcd.log" 2>&1 &
    echo $! >"$STATE_DIR/etcd-$name.pid"
}

# etcd (Debian's etcd-server; etcdctl from etcd-client for the interop tests)
# standalone on 2379 and a 3-member cluster on 2479/2579/2679; protoc for the
# etcd-client crate's build.
start_etcd() {
    ensure_pkg etcd-server etcd
    ensure_pkg etcd-client etcdctl
    ensure_pkg protobuf-compiler protoc
    if port_open 2379; then
        say etcd 127.0.0.1:2379 "already running"
    else
        etcd_member s1 2379 2380 "s1=http://127.0.0.1:2380" fencelock-s1
        wait_port etcd 2379
        say etcd 127.0.0.1:2379 started
    fi
    if port_open 2479 && port_open 2579 && port_open 2679; then
        say "etcd cluster" 127.0.0.1:2479,2579,2679 "already running"
        return
    fi
    local cluster="e1=http://127.0.0.1:2480,e2=http://127.0.0.1:2580,e3=http://127.0.0.1:2680" m
    for m in "e1 2479 2480" "e2 2579 2580" "e3 2679 2680"; do
        # shellcheck disable=SC2086
        etcd_member $m "$cluster" fencelock-cluster
    done
    wait_port "etcd cluster" 2479
    wait_port "etcd cluster" 2579
    wait_port "etcd cluster" 2679
    local i
    for ((i = 0; i < 100; i++)); do
        if ETCDCTL_API=3 etcdctl --endpoints 127.0.0.1:2479,127.0.0.1:2579,127.0.0.1:2679 \
            endpoint health >/dev/null 2>&1; then
            say "etcd cluster" 127.0.0.1:2479,2579,2679 started
            return
        fi
        sleep 0.2
    done
    echo "etcd cluster on 2479/2579/2679 is not healthy; see $STATE_DIR/etcd-e*/etcd.log" >&2
    return 1
}

start_memcached() {
    ensure_pkg memcached memcached
    if port_open 11211; then
        say memcached 127.0.0.1:11211 "already running"
        return
    fi
    memcached -d -l 127.0.0.1 -p 11211 -U 0 -m 64 -u memcache -P "$STATE_DIR/memcached-11211.pid"
    wait_port memcached 11211
    say memcached 127.0.0.1:11211 started
}

setup_python_clients() {
    local venv="$STATE_DIR/pyenv"
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import kazurator' 2>/dev/null; then
        say "python clients" "$venv" "already installed"
        return
    fi
    python3 -m venv "$venv" 2>/dev/null || { ensure_pkg python3-venv /usr/lib/python3/dist-packages/venv; python3 -m venv "$venv"; }
    "$venv/bin/pip" install -q --disable-pip-version-check kazoo==2.11.0 kazurator==0.2.0
    say "python clients" "$venv" installed
}

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
    # The CLI's terminal tests drive `fencelock run` in a real terminal.
    ensure_pkg tmux tmux
    say tmux "$(command -v tmux)" "installed"
    start_redis
    start_redlock
    start_redis_cluster
    start_redis_sentinel
    start_zookeeper
    start_postgres
    start_mariadb
    start_memcached
    start_etcd
    setup_python_clients
}

main "$@"
