#!/usr/bin/env bash
# A two-node SLURM cluster on this one machine (Debian's Slurm 22.05 and munge, run as root), for the tests
# that submit scripts/pretrain_1.3B.sh to a real scheduler. Each node is a slurmd in its own UTS namespace
# (so each has its own host name, node1 and node2) listening on its own port of 127.0.0.1; the controller
# listens on 127.0.0.1 too, so all traffic stays on loopback. Each node declares 32 CPUs and 8 GPUs whatever
# the machine has (SlurmdParameters=config_overrides; Slurm counts a GPU per device file, so the "GPUs" are
# eight links to /dev/null), so the script's --gres=gpu:8, --cpus-per-task=12 and --exclusive are accepted
# unchanged. A CPU training job ignores the CUDA_VISIBLE_DEVICES that SLURM sets.
#
# Idempotent: a cluster already running with this configuration is left alone (its jobs keep running);
# otherwise the daemons it finds (by their pid) are stopped and the two-node cluster is started.
# Installs the packages when they are missing; exits non-zero (and the tests skip) where the cluster
# cannot come up. `.ci/slurm_cluster.sh stop` stops the daemons (munge stays).
set -euo pipefail

NODES=(node1 node2)
PORTS=(6821 6822)
CONF=/etc/slurm/slurm.conf
GRES=/etc/slurm/gres.conf
FAKE_GPUS=/var/spool/slurmd/gdn2-gpus

daemon_pids() {  # the pids of the running processes named $1 (slurmctld / slurmd), one a line
    local pid
    for pid in $(pgrep -x "$1" || true); do echo "$pid"; done
}

stop_daemons() {
    local pids pid
    pids="$(daemon_pids slurmctld) $(daemon_pids slurmd)"
    for pid in $pids; do kill "$pid" 2>/dev/null || true; done
    for _ in $(seq 50); do
        local alive=0
        for pid in $pids; do [ -d "/proc/$pid" ] && alive=1; done
        [ "$alive" = 0 ] && return 0
        sleep 0.2
    done
    for pid in $pids; do [ -d "/proc/$pid" ] && kill -9 "$pid" 2>/dev/null || true; done
    sleep 1
}

if [ "${1:-}" = stop ]; then
    stop_daemons
    exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
        || ! command -v unshare >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq slurmctld slurmd slurm-client munge util-linux >/dev/null
fi

host=$(hostname -s)
# half the machine's memory for each node (nothing enforces it: --mem=0 asks for "all of it")
mem=$(( $(slurmd -C | head -1 | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p') / 2 ))
want_conf=$(cat <<EOF
ClusterName=gdn2
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
GresTypes=gpu
SlurmdParameters=config_overrides
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
NodeName=${NODES[0]} NodeHostname=${NODES[0]} NodeAddr=127.0.0.1 Port=${PORTS[0]} CPUs=32 Boards=1 SocketsPerBoard=1 CoresPerSocket=32 ThreadsPerCore=1 RealMemory=${mem} Gres=gpu:8
NodeName=${NODES[1]} NodeHostname=${NODES[1]} NodeAddr=127.0.0.1 Port=${PORTS[1]} CPUs=32 Boards=1 SocketsPerBoard=1 CoresPerSocket=32 ThreadsPerCore=1 RealMemory=${mem} Gres=gpu:8
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)
want_gres=$(cat <<EOF
AutoDetect=off
NodeName=${NODES[0]},${NODES[1]} Name=gpu File=${FAKE_GPUS}/gpu[0-7]
EOF
)

running() {  # the controller and both node daemons of this configuration are up
    [ "$(cat "$CONF" 2>/dev/null)" = "$want_conf" ] && [ "$(cat "$GRES" 2>/dev/null)" = "$want_gres" ] || return 1
    local f
    for f in /run/slurmctld.pid /run/slurmd-${NODES[0]}.pid /run/slurmd-${NODES[1]}.pid; do
        [ -s "$f" ] && [ -d "/proc/$(cat "$f")" ] || return 1
    done
}

mkdir -p /etc/slurm /var/spool/slurmctld /var/log/slurm /run/munge "$FAKE_GPUS"
for i in 0 1 2 3 4 5 6 7; do ln -sfn /dev/null "$FAKE_GPUS/gpu$i"; done
[ -s /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; chmod 400 /etc/munge/munge.key; }
chown -R munge: /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged --force 2>/dev/null || /usr/sbin/munged --force

if ! running; then
    stop_daemons
    printf '%s\n' "$want_conf" > "$CONF"
    printf '%s\n' "$want_gres" > "$GRES"
    # -c: forget the jobs and nodes of an earlier configuration
    slurmctld -c
    for node in "${NODES[@]}"; do
        mkdir -p "/var/spool/slurmd/$node"
        # its own UTS namespace: the node's jobs see their own host name
        unshare --uts -- sh -c "hostname $node && exec slurmd"
    done
fi

for _ in $(seq 60); do
    states=$(sinfo -h -N -o '%N %T' 2>/dev/null || true)
    if [ "$(grep -c ' idle$' <<<"$states" || true)" = "${#NODES[@]}" ]; then
        sinfo -N
        exit 0
    fi
    sleep 1
done
echo "slurm_cluster.sh: the two nodes did not come up idle; stopping the daemons" >&2
sinfo -N >&2 || true
stop_daemons
exit 1
