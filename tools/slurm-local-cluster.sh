#!/usr/bin/env bash
# A real 2-node Slurm cluster on one Linux machine, for the course and for CI.
#
#   sudo tools/slurm-local-cluster.sh up       # install (apt), start munged, slurmctld, 2 slurmd; wait for idle
#   sudo tools/slurm-local-cluster.sh status   # sinfo, mode, pids
#   sudo tools/slurm-local-cluster.sh down     # stop everything by pid file, delete namespaces and bridge
#   source /tmp/minidist-slurm/env.sh          # then: sinfo, sbatch, squeue, scontrol talk to this cluster
#
# Each "node" is a slurmd in its own network + UTS (+ mount) namespace: its own hostname (node1,
# node2), its own address (10.77.0.11, .12) on an eth0 that is one end of a veth pair whose other
# end sits on a bridge (10.77.0.1) in the root namespace, where slurmctld listens. Each namespace
# bind-mounts its own /etc/hosts listing the controller and both nodes, so names resolve as on a
# real cluster. Everything else (files, /tmp, the venv) is shared: a shared filesystem for free.
# Where namespaces are impossible (no root, containers without CAP_NET_ADMIN) it falls back to two
# slurmd on 127.0.0.1 with different ports (same hostname: see the course chapter).
#
# Needs root (CI runs as root). Only addresses inside the namespaces and bridge this script creates
# (10.77.0.0/24) or loopback are used. Idempotent: `up` on a healthy cluster does nothing, `up` on a
# broken one tears it down first; `down` is safe to run any time.
# Environment: MINIDIST_SLURM_DIR (state, default /tmp/minidist-slurm), MINIDIST_SLURM_MODE
# (auto|netns|loopback), MINIDIST_SLURM_CPUS (CPUs per node, default: this machine's cores),
# MINIDIST_SLURM_INSTALL=0 to never call apt-get. `wait-job JOBID [TIMEOUT]` waits for a job and
# fails at once, with Slurm's reason and what to change, when Slurm says the job can never start.
# Facts this relies on: Slurm 22.05 (Debian 12).
set -euo pipefail

DIR=${MINIDIST_SLURM_DIR:-/tmp/minidist-slurm}
MODE=${MINIDIST_SLURM_MODE:-auto}
# processors usable here: `nproc` alone honours OMP_NUM_THREADS / OMP_THREAD_LIMIT (torchrun and
# HPC profiles export OMP_NUM_THREADS=1, which would give each node CPUs=1 and leave every
# 2-tasks-per-node job pending forever), so count without them.
CPUS=${MINIDIST_SLURM_CPUS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
NODES=(node1 node2)
BR=mdslurm0                 # bridge in the root namespace
NET=10.77.0                 # controller .1, node i .1i
CTL_PORT=6817
CONF=$DIR/slurm.conf

log() { echo "[slurm-local] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
ns_of() { echo "mdslurm-$1"; }

need_root() { [ "$(id -u)" = 0 ] || die "needs root (namespaces, munged, slurmd): run with sudo"; }

install_packages() {
    local missing=()
    for b in slurmctld slurmd sinfo munged ip nsenter unshare; do command -v "$b" >/dev/null || missing+=("$b"); done
    [ ${#missing[@]} = 0 ] && return 0
    [ "${MINIDIST_SLURM_INSTALL:-1}" = 1 ] || die "missing ${missing[*]} and MINIDIST_SLURM_INSTALL=0"
    command -v apt-get >/dev/null || die "missing ${missing[*]}; no apt-get: install Slurm and munge yourself"
    local pkgs="slurmctld slurmd slurm-client munge iproute2 util-linux"
    log "installing $pkgs (apt-get, about 15 s)"
    export DEBIAN_FRONTEND=noninteractive
    timeout 300 apt-get install -y --no-install-recommends $pkgs >"$DIR/log/apt.log" 2>&1 || {
        timeout 300 apt-get update >>"$DIR/log/apt.log" 2>&1
        timeout 300 apt-get install -y --no-install-recommends $pkgs >>"$DIR/log/apt.log" 2>&1 ||
            { tail -n 20 "$DIR/log/apt.log" >&2; die "apt-get install failed"; }
    }
}

netns_possible() {
    local probe=mdslurm-probe$$
    ip netns add "$probe" 2>/dev/null || return 1
    ip netns del "$probe" 2>/dev/null
    unshare --uts --mount true 2>/dev/null || return 1
    ip link add mdslurm-probe type bridge 2>/dev/null || return 1
    ip link del mdslurm-probe 2>/dev/null
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then log "munged already running: using it"; return; fi
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge 2>/dev/null || true
    [ -f /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null;
                                     chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key; }
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/minidist-munged.pid
    cp /run/munge/minidist-munged.pid "$DIR/munged.pid"   # ours: `down` stops it
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return; sleep 0.1; done
    die "munged did not answer (munge -n | unmunge)"
}

write_conf() {   # $1 = controller host name, $2 = controller address, then per node: name addr host port
    local ctl_host=$1 ctl_addr=$2; shift 2
    cat >"$CONF" <<EOF
# Written by tools/slurm-local-cluster.sh ($MODE mode). See the course chapter 08 for each line.
ClusterName=minidist
SlurmctldHost=$ctl_host($ctl_addr)
SlurmctldPort=$CTL_PORT
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait=5
MinJobAge=600
SlurmdTimeout=60
EOF
    while [ $# -gt 0 ]; do
        echo "NodeName=$1 NodeAddr=$2 NodeHostname=$3 Port=$4 CPUs=$CPUS RealMemory=1000 State=UNKNOWN" >>"$CONF"
        shift 4
    done
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
}

up_netns() {
    local ctl_host; ctl_host=$(hostname -s)
    ip link add "$BR" type bridge
    ip addr add "$NET.1/24" dev "$BR"
    ip link set "$BR" up
    {   echo "127.0.0.1 localhost"; echo "$NET.1 $ctl_host controller"
        for i in "${!NODES[@]}"; do echo "$NET.1$((i + 1)) ${NODES[$i]}"; done; } >"$DIR/hosts"
    local args=()
    for i in "${!NODES[@]}"; do
        local n=${NODES[$i]} ns; ns=$(ns_of "${NODES[$i]}")
        ip netns add "$ns"
        ip link add "mdsv$((i + 1))" type veth peer name "mdsv$((i + 1))p"
        ip link set "mdsv$((i + 1))" master "$BR" up
        ip link set "mdsv$((i + 1))p" netns "$ns"
        ip -n "$ns" link set "mdsv$((i + 1))p" name eth0       # eth0 on every node: one GLOO_SOCKET_IFNAME fits all
        ip -n "$ns" addr add "$NET.1$((i + 1))/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        args+=("$n" "$NET.1$((i + 1))" "$n" 6818)
    done
    write_conf "$ctl_host" "$NET.1" "${args[@]}"
    start_ctld
    for n in "${NODES[@]}"; do
        # not `ip netns exec`: it remounts /sys and slurmd 22.05 then fails to find its cgroup plugin
        nsenter --net="/run/netns/$(ns_of "$n")" unshare --uts --mount sh -c \
            "mount --bind '$DIR/hosts' /etc/hosts && hostname $n && exec slurmd -f '$CONF' -N $n" \
            || die "slurmd $n failed to start; see $DIR/log/slurmd-$n.log"
    done
}

up_loopback() {
    local h; h=$(hostname)
    write_conf "$h" 127.0.0.1 node1 127.0.0.1 "$h" 17001 node2 127.0.0.1 "$h" 17002
    start_ctld
    for n in "${NODES[@]}"; do slurmd -f "$CONF" -N "$n" || die "slurmd $n failed to start"; done
}

start_ctld() {
    mkdir -p "$DIR/ctld" "$DIR/spool/node1" "$DIR/spool/node2"
    slurmctld -f "$CONF" -i || die "slurmctld failed to start; see $DIR/log/slurmctld.log"
}

wait_idle() {
    export SLURM_CONF=$CONF
    local states=""
    for _ in $(seq 300); do   # 30 s
        states=$(sinfo -h -N -o "%N=%T" 2>/dev/null | sort -u | tr '\n' ' ')
        [ "$states" = "node1=idle node2=idle " ] && return 0
        sleep 0.1
    done
    log "nodes not idle after 30 s: ${states:-no answer from slurmctld}"
    for f in "$DIR"/log/*.log; do echo "== $f" >&2; tail -n 15 "$f" >&2; done
    return 1
}

cmd_up() {
    need_root
    mkdir -p "$DIR/log"
    if [ -f "$DIR/mode" ] && pid_alive "$DIR/slurmctld.pid" && pid_alive "$DIR/slurmd-node1.pid" &&
       pid_alive "$DIR/slurmd-node2.pid" && wait_idle 2>/dev/null; then
        log "already up ($(cat "$DIR/mode") mode)"; return 0
    fi
    cmd_down quiet
    mkdir -p "$DIR/log"
    local t0=$SECONDS
    install_packages
    if [ "$MODE" = auto ]; then if netns_possible; then MODE=netns; else MODE=loopback; fi; fi
    [ "$MODE" = netns ] || [ "$MODE" = loopback ] || die "MINIDIST_SLURM_MODE must be auto, netns or loopback"
    echo "$MODE" >"$DIR/mode"
    [ "$MODE" = loopback ] && log "network namespaces unavailable: loopback fallback (both nodes share one hostname)"
    start_munge
    "up_$MODE"
    wait_idle || { cmd_down quiet; die "cluster did not come up"; }
    echo "export SLURM_CONF=$CONF" >"$DIR/env.sh"
    [ "$MODE" = netns ] && echo "export GLOO_SOCKET_IFNAME=eth0" >>"$DIR/env.sh"
    if [ "$MODE" = loopback ]; then   # both nodes are this host: what the course's templates then need
        { echo "export GLOO_SOCKET_IFNAME=lo HEAD_ADDR=$(hostname)"
          echo "export TORCHRUN_ARGS=--local_addr=$(hostname) TRAIN_ARGS=--no-host-check"; } >>"$DIR/env.sh"
    fi
    log "up in $((SECONDS - t0)) s ($MODE mode): source $DIR/env.sh, then sinfo / sbatch"
    sinfo -N -o "%N %T %c %o" >&2
}

stop_pidfile() {   # stop the daemon in pid file $1: SIGTERM, then SIGKILL after 5 s
    [ -f "$1" ] || return 0
    local pid; pid=$(cat "$1")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$1"
}

cmd_down() {
    need_root
    [ -d "$DIR" ] || return 0
    if [ -f "$CONF" ] && pid_alive "$DIR/slurmctld.pid"; then   # cancel jobs so no step outlives its slurmd
        SLURM_CONF=$CONF timeout 10 scancel --quiet --full --partition=debug 2>/dev/null || true
    fi
    for n in "${NODES[@]}"; do stop_pidfile "$DIR/slurmd-$n.pid"; done
    stop_pidfile "$DIR/slurmctld.pid"
    for n in "${NODES[@]}"; do     # anything left in a node namespace (job steps): kill it by pid
        local ns; ns=$(ns_of "$n")
        if [ -e "/run/netns/$ns" ]; then
            for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
            ip netns del "$ns" 2>/dev/null || true
        fi
    done
    for i in 1 2; do ip link del "mdsv$i" 2>/dev/null || true; done
    ip link del "$BR" 2>/dev/null || true
    stop_pidfile "$DIR/munged.pid"
    rm -rf "$DIR/ctld" "$DIR/spool" "$DIR/hosts" "$DIR/mode" "$DIR/env.sh" "$CONF"
    [ "${1:-}" = quiet ] || log "down"
}

cmd_status() {
    [ -f "$DIR/mode" ] || { echo "down"; return 1; }
    echo "mode: $(cat "$DIR/mode")  state: $DIR"
    for f in "$DIR"/*.pid; do [ -f "$f" ] && echo "$(basename "$f" .pid): pid $(cat "$f") $(pid_alive "$f" && echo running || echo DEAD)"; done
    SLURM_CONF=$CONF sinfo -N -o "%N %T %c %o"
}

# Pending reasons after which Slurm will never start the job as submitted (squeue's %r).
NEVER_START="PartitionConfig PartitionNodeLimit PartitionTimeLimit PartitionDown BadConstraints InvalidAccount InvalidQOS"

never_start_hint() {   # $1 = reason: what to change
    case "$1" in
        PartitionConfig) echo "the job asks for more than a node of the partition has (tasks per node x cpus per task above a node's CPUs=, or more nodes than it has): compare \`scontrol show job\` with \`sinfo -N -o '%N %c %m'\`; on this local cluster set MINIDIST_SLURM_CPUS or lower --ntasks-per-node / --cpus-per-task" ;;
        PartitionNodeLimit) echo "--nodes is outside the partition's MinNodes..MaxNodes: ask for fewer nodes" ;;
        PartitionTimeLimit) echo "--time is above the partition's MaxTime: ask for less time" ;;
        PartitionDown) echo "the partition is down: \`scontrol update PartitionName=... State=UP\`" ;;
        *) echo "fix the request named by the reason (see squeue(1), JOB REASON CODES)" ;;
    esac
}

cmd_wait_job() {   # $1 = job id, $2 = timeout (s): 0 when it ended, 1 when it can never start or timed out
    local jid=${1:?usage: wait-job JOBID [TIMEOUT]} timeout=${2:-600} t0=$SECONDS line state reason
    export SLURM_CONF=${SLURM_CONF:-$CONF}
    while [ $((SECONDS - t0)) -lt "$timeout" ]; do
        line=$(squeue -h -j "$jid" -o "%T %r" 2>/dev/null || true)
        [ -z "$line" ] && return 0                      # left the queue: ended
        state=${line%% *}; reason=${line#* }
        if [ "$state" = PENDING ] && [[ " $NEVER_START " == *" $reason "* ]]; then
            scancel "$jid" 2>/dev/null || true
            log "job $jid can never start (Slurm's reason: $reason): $(never_start_hint "$reason")"
            return 1
        fi
        sleep 0.5
    done
    scancel "$jid" 2>/dev/null || true
    log "job $jid still in the queue after $timeout s: $line"; return 1
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    wait-job) shift; cmd_wait_job "$@" ;;
    *) echo "usage: $0 up|down|status|wait-job JOBID [TIMEOUT]" >&2; exit 2 ;;
esac
