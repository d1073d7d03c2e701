#!/bin/bash
# (b) srun starts one task per rank; no torchrun. minidist.init() maps SLURM_PROCID -> rank,
#     SLURM_LOCALID -> local rank, SLURM_NTASKS -> world size, SLURM_NODEID -> node.  CPU / gloo.
#     sbatch course/multinode/sbatch_srun_cpu.sh              (from the repository root)
#SBATCH --job-name=minidist-srun       # the name squeue shows; %x in --output below
#SBATCH --nodes=2                      # two machines
#SBATCH --ntasks-per-node=2            # two ranks per node: srun starts 4 processes in all
#SBATCH --cpus-per-task=1              # one core per rank
#SBATCH --time=00:10:00                # wall-clock limit
#SBATCH --output=%x-%j.out             # stdout+stderr: job name and job id

set -euo pipefail
PYTHON=${PYTHON:-python3}              # the interpreter with torch and minidist
TRAIN=${TRAIN:-$SLURM_SUBMIT_DIR/course/multinode/train.py}   # (this file is copied to Slurm's spool)
OUT=${OUT:-$SLURM_SUBMIT_DIR/runs/$SLURM_JOB_ID}              # a SHARED folder for results/checkpoints
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)   # first node: hosts the TCPStore
# Without torchrun nobody sets MASTER_ADDR/PORT: export them; every task inherits them. Use the
# head's address as Slurm knows it (never localhost: the other node would connect to itself);
# an exported HEAD_ADDR wins (the local cluster's loopback fallback passes the machine's hostname).
HEAD_ADDR=${HEAD_ADDR:-$(scontrol show node "$HEAD" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)}
export MASTER_ADDR=$HEAD_ADDR
export MASTER_PORT=${PORT:-29500}      # must be free on the head node
export OMP_NUM_THREADS=1               # one intra-op thread per rank
# export GLOO_SOCKET_IFNAME=eth0       # the interface between nodes, if the hostname's is wrong
echo "job $SLURM_JOB_ID: $SLURM_NTASKS ranks on $SLURM_JOB_NODELIST, store at $MASTER_ADDR:$MASTER_PORT"

# One process per task. Global rank 0 is task 0 (on the first node here), but code must never
# assume it: rank 0 of a torchrun job can land on any node. --kill-on-bad-exit=1 ends the job when
# a rank dies instead of leaving the others waiting in a collective until the timeout.
srun --kill-on-bad-exit=1 "$PYTHON" "$TRAIN" --out="$OUT" --ckpt="$OUT" --backend=gloo ${TRAIN_ARGS:-}
