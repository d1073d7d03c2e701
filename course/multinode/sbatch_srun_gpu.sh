#!/bin/bash
# (b) srun starts one task per GPU; no torchrun. minidist.init() maps SLURM_PROCID -> rank,
#     SLURM_LOCALID -> local rank (= the GPU index), SLURM_NTASKS -> world size.  GPU / nccl.
#     sbatch course/multinode/sbatch_srun_gpu.sh              (from the repository root)
#SBATCH --job-name=minidist-srun-gpu   # the name squeue shows; %x in --output below
#SBATCH --nodes=2                      # two machines
#SBATCH --ntasks-per-node=4            # one task (rank) per GPU
#SBATCH --gpus-per-node=4              # every task sees all 4 GPUs and takes cuda:SLURM_LOCALID.
#                                        (NOT --gpus-per-task=1: then each task sees one GPU as
#                                        cuda:0, and cuda:SLURM_LOCALID does not exist for tasks 1-3)
#SBATCH --cpus-per-task=4              # cores per rank
#SBATCH --time=00:30:00                # wall-clock limit
#SBATCH --output=%x-%j.out             # stdout+stderr: job name and job id

set -euo pipefail
PYTHON=${PYTHON:-python3}              # the interpreter with torch (a CUDA build) and minidist
TRAIN=${TRAIN:-$SLURM_SUBMIT_DIR/course/multinode/train.py}   # (this file is copied to Slurm's spool)
OUT=${OUT:-$SLURM_SUBMIT_DIR/runs/$SLURM_JOB_ID}              # a SHARED folder for results/checkpoints
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)   # first node: hosts the TCPStore
HEAD_ADDR=${HEAD_ADDR:-$(scontrol show node "$HEAD" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)}
export MASTER_ADDR=$HEAD_ADDR   # never localhost
export MASTER_PORT=${PORT:-29500}      # must be free on the head node
export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK   # intra-op threads per rank = its cores
# export NCCL_SOCKET_IFNAME=ib0        # NCCL's bootstrap interface (prefix match; ^docker,lo excludes)
echo "job $SLURM_JOB_ID: $SLURM_NTASKS ranks on $SLURM_JOB_NODELIST, store at $MASTER_ADDR:$MASTER_PORT"

# One process per task, started by srun on every node; --kill-on-bad-exit=1 ends the job when a
# rank dies instead of leaving the others waiting in a collective until the timeout.
srun --kill-on-bad-exit=1 "$PYTHON" "$TRAIN" --out="$OUT" --ckpt="$OUT" --backend=nccl ${TRAIN_ARGS:-}
