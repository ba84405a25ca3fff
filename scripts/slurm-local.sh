#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for tests/test_slurm.py and for trying the
# `workflow/profiles/slurm` profile without a real cluster.
#
#   scripts/slurm-local.sh start    # install slurm-wlm + munge if missing, configure, start, wait for "idle"
#   scripts/slurm-local.sh status   # sinfo; exit 0 when the node is usable
#   scripts/slurm-local.sh stop     # stop slurmctld, slurmd and munged (those this script started)
#
# Needs root and apt-get (Debian/Ubuntu).  Writes /etc/slurm/slurm.conf and
# /etc/slurm/gres.conf (the previous files are kept as *.xmc-backup), runs munged,
# slurmctld and slurmd as root.  The node advertises one fake GPU (gres.conf
# `File=/dev/null`): jobs asking for `--gpus=1` are scheduled and get
# CUDA_VISIBLE_DEVICES, but there is no real device behind it.  Accounting is off
# (no slurmdbd): use the executor's `status_command: squeue`.  Jobs inherit the
# daemons' niceness (PropagatePrioProcess=0), so `nice -n 19 scripts/slurm-local.sh start`
# runs every job at low priority.
#
# Environment: SLURM_LOCAL_CONF_DIR (default /etc/slurm), SLURM_LOCAL_STATE_DIR
# (default /var/spool/slurm-local), SLURM_LOCAL_WAIT (seconds to wait for the node, 90).
set -euo pipefail

CONF_DIR=${SLURM_LOCAL_CONF_DIR:-/etc/slurm}
STATE_DIR=${SLURM_LOCAL_STATE_DIR:-/var/spool/slurm-local}
WAIT_S=${SLURM_LOCAL_WAIT:-90}
LOG_DIR=$STATE_DIR/log
RUN_DIR=$STATE_DIR/run
MUNGE_RUN=/run/munge
HOST=$(hostname -s)
export SLURM_CONF=$CONF_DIR/slurm.conf

say() { echo "slurm-local: $*" >&2; }
die() { say "error: $*"; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts daemons)"; }

install_if_missing() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sinfo >/dev/null \
        && command -v munged >/dev/null; then
        return
    fi
    command -v apt-get >/dev/null || die "slurm-wlm/munge are missing and there is no apt-get to install them"
    say "installing slurm-wlm munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null
}

node_state() {  # the node's state as sinfo prints it (idle, mix, alloc, down*, drain, ...), or nothing
    sinfo -h -N -n "$HOST" -o '%t' 2>/dev/null | head -1 || true
}

node_ready() {
    case "$(node_state)" in
        idle|mix|mixed|alloc|allocated|comp|completing) return 0 ;;
        *) return 1 ;;
    esac
}

write_conf() {
    # the hardware as slurmd sees it, so the node is not drained for a mismatch
    local hw cpus sockets cores threads mem real_mem
    hw=$(slurmd -C 2>/dev/null | head -1) || true
    cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hw"); cpus=${cpus:-$(nproc)}
    sockets=$(sed -n 's/.*SocketsPerBoard=\([0-9]*\).*/\1/p' <<<"$hw"); sockets=${sockets:-1}
    cores=$(sed -n 's/.*CoresPerSocket=\([0-9]*\).*/\1/p' <<<"$hw"); cores=${cores:-$cpus}
    threads=$(sed -n 's/.*ThreadsPerCore=\([0-9]*\).*/\1/p' <<<"$hw"); threads=${threads:-1}
    mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
    [ -n "$mem" ] || mem=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
    real_mem=$(( mem * 92 / 100 ))   # a bit under the machine's

    mkdir -p "$CONF_DIR" "$STATE_DIR/ctld" "$STATE_DIR/d" "$LOG_DIR" "$RUN_DIR"
    for f in slurm.conf gres.conf; do
        if [ -f "$CONF_DIR/$f" ] && ! grep -q '^# written by scripts/slurm-local.sh' "$CONF_DIR/$f"; then
            cp -p "$CONF_DIR/$f" "$CONF_DIR/$f.xmc-backup"
        fi
    done
    cat >"$CONF_DIR/slurm.conf" <<EOF
# written by scripts/slurm-local.sh: a one-node test cluster on $HOST
ClusterName=xmc-local
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
PropagatePrioProcess=0
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
# no slurmdbd: the executor must use 'squeue' for job states, which sees finished
# jobs for MinJobAge seconds (>= 3 x the executor's init_seconds_before_status_checks); two hours:
# tests/test_slurm.py's run starts with the test session and its tests read the jobs back (scontrol)
# only when their turn comes, after the rest of a CI run (90 minutes at most)
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=7200
SlurmctldTimeout=60
SlurmdTimeout=60
InactiveLimit=0
KillWait=10
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/d
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=$HOST CPUs=$cpus Sockets=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads RealMemory=$real_mem Gres=gpu:1 State=UNKNOWN
PartitionName=cpu Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$CONF_DIR/gres.conf" <<EOF
# written by scripts/slurm-local.sh: one fake GPU, so that --gpus=1 jobs can be scheduled
AutoDetect=off
NodeName=$HOST Name=gpu File=/dev/null Count=1
EOF
    say "wrote $CONF_DIR/slurm.conf (node $HOST: CPUs=$cpus RealMemory=$real_mem Gres=gpu:1, partition cpu)"
}

start_munge() {
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        return  # a munged is already answering
    fi
    if [ ! -s /etc/munge/munge.key ]; then
        say "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile=/etc/munge/munge.key
        else
            dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
        fi
    fi
    local user=root
    id munge >/dev/null 2>&1 && user=munge
    mkdir -p "$MUNGE_RUN" /var/log/munge /var/lib/munge
    chown "$user" "$MUNGE_RUN" /var/log/munge /var/lib/munge /etc/munge /etc/munge/munge.key
    chmod 0700 /etc/munge
    chmod 0400 /etc/munge/munge.key
    chmod 0755 "$MUNGE_RUN"
    say "starting munged (as $user)"
    if [ "$user" = root ]; then
        munged --force
    else
        runuser -u munge -- munged
    fi
    for _ in $(seq 1 20); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 0.5
    done
    die "munged does not answer (see /var/log/munge/munged.log)"
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

cmd_start() {
    need_root
    install_if_missing
    # already running?  (ask sinfo only when a controller may be up: without one it
    # takes seconds to give up)
    if pid_alive "$RUN_DIR/slurmctld.pid" \
        || { [ -f "$SLURM_CONF" ] && ! grep -q '^# written by scripts/slurm-local.sh' "$SLURM_CONF"; }; then
        if node_ready; then
            say "already up: node $HOST is $(node_state)"
            return 0
        fi
    fi
    write_conf
    start_munge
    if ! pid_alive "$RUN_DIR/slurmctld.pid"; then
        say "starting slurmctld"
        slurmctld -f "$SLURM_CONF" || die "slurmctld did not start (see $LOG_DIR/slurmctld.log)"
    fi
    if ! pid_alive "$RUN_DIR/slurmd.pid"; then
        say "starting slurmd"
        slurmd -f "$SLURM_CONF" || die "slurmd did not start (see $LOG_DIR/slurmd.log)"
    fi
    local t0=$SECONDS state
    while (( SECONDS - t0 < WAIT_S )); do
        state=$(node_state)
        case "$state" in
            idle|mix|alloc) say "node $HOST is $state after $((SECONDS - t0)) s"; sinfo >&2; return 0 ;;
            down*|drain*|drng*|fail*)
                # e.g. down after a restart: ReturnToService=2 normally clears it; help it once
                scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true ;;
        esac
        sleep 1
    done
    sinfo -N -l >&2 || true
    tail -n 20 "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" >&2 || true
    die "node $HOST not idle after ${WAIT_S} s (state: ${state:-unknown})"
}

cmd_stop() {
    need_root
    local f
    for f in slurmd slurmctld; do
        if pid_alive "$RUN_DIR/$f.pid"; then
            say "stopping $f"
            kill "$(cat "$RUN_DIR/$f.pid")" || true
        fi
    done
    for _ in $(seq 1 30); do
        pid_alive "$RUN_DIR/slurmd.pid" || pid_alive "$RUN_DIR/slurmctld.pid" || break
        sleep 0.5
    done
    if [ -f "$MUNGE_RUN/munged.pid" ] && kill -0 "$(cat "$MUNGE_RUN/munged.pid")" 2>/dev/null; then
        say "stopping munged"
        kill "$(cat "$MUNGE_RUN/munged.pid")" || true
    fi
}

cmd_status() {
    command -v sinfo >/dev/null || { say "sinfo not installed"; return 1; }
    sinfo || return 1
    node_ready
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
