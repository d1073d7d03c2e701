#!/bin/bash
# Start one Slurm daemon in the foreground (the container's main process): slurmctld or slurmd.
# munged runs beside it with the key baked into the image (same key in every container).
set -euo pipefail
install -d -o munge -g munge -m 0755 /run/munge
runuser -u munge -- /usr/sbin/munged
mkdir -p /var/spool/slurmctld /var/spool/slurmd
case "${1:?usage: slurm-entrypoint.sh slurmctld|slurmd}" in
    slurmctld) exec slurmctld -D -i -f "$SLURM_CONF" ;;
    slurmd)    exec slurmd -D -f "$SLURM_CONF" -N "$(hostname)" ;;
    *) exec "$@" ;;
esac
