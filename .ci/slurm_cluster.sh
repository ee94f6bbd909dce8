#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (Debian's Slurm 22.05 and munge, run as root), for the test
# that submits scripts/pretrain_1.3B.sh to a real scheduler. Installs the packages when they are missing;
# exits non-zero (and the test skips) where that is not possible.
set -euo pipefail
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi
host=$(hostname -s)
node=$(slurmd -C | head -1)  # NodeName=<host> CPUs=... RealMemory=...
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
cat > /etc/slurm/slurm.conf <<EOF
ClusterName=gdn2
SlurmctldHost=${host}
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
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
${node}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
[ -s /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; chmod 400 /etc/munge/munge.key; }
chown -R munge: /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged --force 2>/dev/null || /usr/sbin/munged --force
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd
for _ in $(seq 30); do
    if sinfo -h -o %T 2>/dev/null | grep -q idle; then
        sinfo
        exit 0
    fi
    sleep 1
done
echo "slurm_cluster.sh: the node did not come up idle" >&2
sinfo >&2 || true
exit 1
