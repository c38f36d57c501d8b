#!/usr/bin/env bash
# A single-node Ceph cluster with a RADOS Gateway (S3) on loopback, for the
# `rgw` test tier and for benchmarks against a real S3 server.
#
#   bash scripts/ceph_rgw.sh start    # install (apt) if missing, bring up, print the env
#   bash scripts/ceph_rgw.sh env      # export lines for the running server
#   bash scripts/ceph_rgw.sh status
#   bash scripts/ceph_rgw.sh stop     # stop every daemon and delete the state
#
#   eval "$(bash scripts/ceph_rgw.sh env)"
#
# One monitor, one OSD on a sparse file, no manager, cluster auth off (S3
# signatures are still checked by the gateway), pool size 1, messenger v1
# only, everything bound to 127.0.0.1.  Debian's radosgw has no standalone
# dbstore backend, hence the monitor and the OSD.  State (config, logs, data,
# pids, ports) lives in $DCPSTORE_RGW_DIR (default /tmp/dcpstore-rgw).
#
# Knobs: DCPSTORE_RGW_DIR, DCPSTORE_RGW_BLOCK_GIB (OSD block file, sparse; 8),
# DCPSTORE_RGW_ACCESS_KEY / DCPSTORE_RGW_SECRET_KEY (the S3 user's keys),
# DCPSTORE_RGW_TIMEOUT (seconds each readiness wait may take; 180),
# DCPSTORE_RGW_FAILED_LOGS (a folder where a failed start leaves its daemons'
# logs, which `stop` would otherwise delete with the state).
set -euo pipefail

DIR=${DCPSTORE_RGW_DIR:-/tmp/dcpstore-rgw}
BLOCK_GIB=${DCPSTORE_RGW_BLOCK_GIB:-8}
ACCESS_KEY=${DCPSTORE_RGW_ACCESS_KEY:-dcpstoreaccesskey}
SECRET_KEY=${DCPSTORE_RGW_SECRET_KEY:-dcpstoresecretkey0123456789}
REGION=us-east-1
TIMEOUT=${DCPSTORE_RGW_TIMEOUT:-180}
CONF=$DIR/ceph.conf

log() { echo "ceph_rgw: $*" >&2; }
die() { log "$*"; exit 1; }

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

pid_alive() { [[ -f $DIR/run/$1.pid ]] && kill -0 "$(cat "$DIR/run/$1.pid")" 2>/dev/null; }

rgw_port() { cat "$DIR/rgw.port"; }

# Poll "$@" until it succeeds, at most $TIMEOUT seconds; $1 names what we wait for.
wait_for() {
    local what=$1 daemon=$2
    shift 2
    local deadline=$((SECONDS + TIMEOUT))
    until "$@" >/dev/null 2>&1; do
        if [[ -n $daemon ]] && ! pid_alive "$daemon"; then
            tail -n 30 "$DIR/log/$daemon.out" "$DIR/log/"*"$daemon"*.log 2>/dev/null >&2 || true
            die "$daemon exited while waiting for $what (logs in $DIR/log)"
        fi
        ((SECONDS < deadline)) || die "timed out after ${TIMEOUT}s waiting for $what (logs in $DIR/log)"
        sleep 0.5
    done
}

ceph_cli() { timeout 30 ceph -c "$CONF" --connect-timeout 10 "$@"; }

s3_answers() { curl -fsS -o /dev/null --max-time 5 "http://127.0.0.1:$(rgw_port)/"; }

osd_up() { [[ $(ceph_cli osd dump --format json | python3 -c 'import json, sys; print(sum(o["up"] for o in json.load(sys.stdin)["osds"]))') -ge 1 ]]; }

# Run a daemon in the foreground of its own session, detached from this shell.
launch() {
    local name=$1
    shift
    setsid nohup "$@" >"$DIR/log/$name.out" 2>&1 </dev/null &
    echo $! >"$DIR/run/$name.pid"
}

install_packages() {
    local missing=()
    command -v ceph-mon >/dev/null || missing+=(ceph-mon)
    command -v ceph-osd >/dev/null || missing+=(ceph-osd)
    command -v radosgw >/dev/null || missing+=(radosgw)
    command -v ceph-authtool >/dev/null || missing+=(ceph-common)
    command -v curl >/dev/null || missing+=(curl)
    ((${#missing[@]} == 0)) && return 0
    log "installing ${missing[*]} with apt"
    local sudo=()
    ((EUID == 0)) || sudo=(sudo)
    "${sudo[@]}" apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends \
        ceph-mon ceph-osd radosgw ceph-common curl >&2
}

print_env() {
    echo "export AWS_ENDPOINT_URL=http://127.0.0.1:$(rgw_port)"
    echo "export AWS_ACCESS_KEY_ID=$ACCESS_KEY"
    echo "export AWS_SECRET_ACCESS_KEY=$SECRET_KEY"
    echo "export AWS_DEFAULT_REGION=$REGION"
}

running() { pid_alive mon && pid_alive osd && pid_alive rgw && [[ -f $DIR/ready ]]; }

write_conf() {
    local fsid=$1 mon_port=$2 rgw_port=$3
    cat >"$CONF" <<EOF
[global]
fsid = $fsid
mon host = v1:127.0.0.1:$mon_port
public addr = 127.0.0.1
ms bind msgr2 = false
ms bind ipv6 = false
auth cluster required = none
auth service required = none
auth client required = none
keyring = $DIR/keyring
run dir = $DIR/run
admin socket = $DIR/run/\$name.asok
log file = $DIR/log/\$name.log
crash dir = $DIR/crash
log to stderr = false
err to stderr = true
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail warn = 2
mon data avail crit = 1
ms async op threads = 2

[mon]
mon data = $DIR/mon/\$cluster-\$id

[osd]
osd data = $DIR/osd/\$cluster-\$id
osd objectstore = bluestore
bluestore block create = true
bluestore block path = $DIR/osd/block
bluestore block size = $((BLOCK_GIB << 30))
bluestore fsck on mount = false
bluestore cache autotune = false
bluestore cache size = 134217728
osd memory target = 1073741824
osd op num shards = 2
osd op num threads per shard = 1
osd max object name len = 460
osd max object namespace len = 64
# The booting OSD would set its device class and crush location with mon
# commands of its own; when one goes out before its MonClient holds the
# cluster's fsid it carries a zero fsid, the monitor answers "wrong fsid",
# and the OSD exits (seen after another cluster had run on this machine).
# The script puts osd.0 in the crush map itself, and a device class is unused.
osd class update on start = false
osd crush update on start = false

[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$rgw_port
rgw data = $DIR/rgw
rgw thread pool size = 64
rgw enable usage log = false
# Deleted objects' data goes to RGW's garbage collector, which by default
# waits 2 h and runs hourly: a benchmark that writes and deletes a few GiB
# would fill the small OSD, and a full OSD blocks every write (the gateway
# stops reading request bodies).  Reclaim within seconds instead.
rgw gc obj min wait = 5
rgw gc processor period = 5
rgw gc processor max time = 5
EOF
}

start() {
    # Once more from scratch if a daemon does not come up: CI needs the tier.
    (start_once) && return 0
    keep_logs first-try
    log "start failed; cleaning up and trying once more"
    stop_daemons
    rm -rf "$DIR"
    (start_once) && return 0
    keep_logs second-try
    return 1
}

# Copy a failed start's logs to $DCPSTORE_RGW_FAILED_LOGS, if set, as $1-<log>.
keep_logs() {
    local kept=${DCPSTORE_RGW_FAILED_LOGS:-} f
    [[ -n $kept && -d $DIR/log ]] || return 0
    mkdir -p "$kept"
    for f in "$DIR"/log/*; do
        cp "$f" "$kept/$1-$(basename "$f")"
    done
    log "kept the logs of the $1 in $kept"
}

start_once() {
    if running; then
        log "already running (state in $DIR)"
        print_env
        return 0
    fi
    if [[ -d $DIR ]]; then
        log "found a stale $DIR; cleaning it up"
        stop_daemons
        rm -rf "$DIR"
    fi
    install_packages
    local t0=$SECONDS
    mkdir -p "$DIR"/{run,log,crash,mon,osd/ceph-0,rgw}
    local fsid mon_port rgw_port
    fsid=$(uuidgen)
    mon_port=$(free_port)
    rgw_port=$(free_port)
    echo "$rgw_port" >"$DIR/rgw.port"
    write_conf "$fsid" "$mon_port" "$rgw_port"

    log "monitor on v1:127.0.0.1:$mon_port"
    ceph-authtool --create-keyring "$DIR/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
    ceph-authtool "$DIR/keyring" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' \
        --cap mds 'allow *' --cap mgr 'allow *' >/dev/null
    monmaptool --create --fsid "$fsid" --addv a "[v1:127.0.0.1:$mon_port]" "$DIR/monmap" >/dev/null
    ceph-mon -c "$CONF" --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/keyring"
    launch mon ceph-mon -f -c "$CONF" -i a
    wait_for "the monitor" mon ceph_cli mon stat

    log "OSD on a ${BLOCK_GIB} GiB sparse file"
    # The OSD's uuid given to both sides, as Ceph's manual deployment does:
    # without it the booting OSD's own create can meet "wrong fsid".
    local id osd_uuid
    osd_uuid=$(uuidgen)
    id=$(ceph_cli osd create "$osd_uuid")
    [[ $id == 0 ]] || die "expected osd id 0, got '$id'"
    ceph-osd -c "$CONF" -i 0 --mkfs --osd-uuid "$osd_uuid" >"$DIR/log/osd-mkfs.out" 2>&1 ||
        { cat "$DIR/log/osd-mkfs.out" >&2; die "ceph-osd --mkfs failed"; }
    ceph_cli osd crush add osd.0 1.0 root=default host=localhost >/dev/null 2>&1
    launch osd ceph-osd -f -c "$CONF" -i 0
    wait_for "the OSD to be up" osd osd_up

    log "RADOS Gateway on http://127.0.0.1:$rgw_port"
    launch rgw radosgw -f -c "$CONF" -n client.rgw.a
    wait_for "the gateway to answer S3" rgw s3_answers
    timeout 120 radosgw-admin -c "$CONF" -n client.admin user create --uid=dcpstore --display-name=dcpstore \
        --access-key="$ACCESS_KEY" --secret-key="$SECRET_KEY" >"$DIR/log/user-create.out" 2>&1 ||
        { cat "$DIR/log/user-create.out" >&2; die "radosgw-admin user create failed"; }
    touch "$DIR/ready"
    log "ready in $((SECONDS - t0))s"
    print_env
}

stop_daemons() {
    local name pid
    for name in rgw osd mon; do
        [[ -f $DIR/run/$name.pid ]] || continue
        pid=$(cat "$DIR/run/$name.pid")
        kill -TERM "$pid" 2>/dev/null || continue
        for _ in $(seq 1 60); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.25
        done
        kill -KILL "$pid" 2>/dev/null || true
    done
}

stop() {
    if [[ ! -d $DIR ]]; then
        log "not running (no $DIR)"
        return 0
    fi
    stop_daemons
    rm -rf "$DIR"
    log "stopped; removed $DIR"
}

case "${1:-}" in
start) start ;;
stop) stop ;;
env)
    running || die "not running; run: bash $0 start"
    print_env
    ;;
status)
    if running; then
        log "running: http://127.0.0.1:$(rgw_port) (state in $DIR)"
    else
        log "not running"
        exit 1
    fi
    ;;
*)
    echo "usage: $0 start|stop|env|status" >&2
    exit 2
    ;;
esac
