#!/bin/bash
# TEST RIG ONLY: make a one-node Slurm cluster on this machine (Debian 12, as root) to rehearse
# deploy/slurm: install slurm-wlm and munge, write /etc/slurm/slurm.conf from slurm.conf here,
# start munged, slurmctld and slurmd. `setup.sh stop` stops the three daemons again; `setup.sh
# purge` also removes the spool and log folders it wrote (packages and /etc/slurm stay).
# Not for a real cluster (see the head of slurm.conf).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
HOST=$(hostname -s)

stop() {
    local pidfile pid
    for pidfile in /run/slurmd.pid /run/slurmctld.pid /run/munge/munged.pid; do
        pid=$(cat "$pidfile" 2>/dev/null) || continue
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid"
            echo "stopped $(basename "$pidfile" .pid) (pid $pid)"
        fi
    done
}
case "${1:-}" in
    stop) stop; exit 0 ;;
    purge)  # stop, and remove the state and logs this rig wrote (the packages and /etc stay)
        stop
        sleep 2
        rm -rf /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /var/log/munge/munged.log
        echo "removed /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /var/log/munge/munged.log"
        exit 0 ;;
esac

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm munge
fi

# munge: the package made /etc/munge/munge.key; make one if it is missing
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! munge -n >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged
    sleep 1
fi
munge -n | unmunge >/dev/null && echo "munged: up"

# slurm
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
chown slurm:slurm /var/spool/slurmctld /var/log/slurm
sed "s/@HOST@/$HOST/g" "$HERE/slurm.conf" >/etc/slurm/slurm.conf
touch /var/log/slurm/jobcomp.log
chown slurm:slurm /var/log/slurm/jobcomp.log
[ -f /run/slurmctld.pid ] && kill -0 "$(cat /run/slurmctld.pid)" 2>/dev/null || /usr/sbin/slurmctld
[ -f /run/slurmd.pid ] && kill -0 "$(cat /run/slurmd.pid)" 2>/dev/null || /usr/sbin/slurmd
for _ in $(seq 30); do
    if sinfo -h -o '%T' 2>/dev/null | grep -qx idle; then break; fi
    sleep 1
done
sinfo
