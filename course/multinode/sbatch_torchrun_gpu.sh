#!/bin/bash
# (a) One task per node; torchrun starts one worker per GPU.  GPU / nccl variant.
#     sbatch course/multinode/sbatch_torchrun_gpu.sh          (from the repository root)
#SBATCH --job-name=minidist-torchrun-gpu   # the name squeue shows; %x in --output below
#SBATCH --nodes=2                      # two machines
#SBATCH --ntasks-per-node=1            # ONE task per node: torchrun starts the workers (srun x torchrun = too many)
#SBATCH --gpus-per-node=4              # GPUs per node; torchrun starts one worker for each
#SBATCH --cpus-per-task=16             # cores for the 4 workers and their data loaders
#SBATCH --time=00:30:00                # wall-clock limit
#SBATCH --output=%x-%j.out             # stdout+stderr: job name and job id

set -euo pipefail
PYTHON=${PYTHON:-python3}              # the interpreter with torch (a CUDA build) and minidist
TRAIN=${TRAIN:-$SLURM_SUBMIT_DIR/course/multinode/train.py}   # (this file is copied to Slurm's spool)
OUT=${OUT:-$SLURM_SUBMIT_DIR/runs/$SLURM_JOB_ID}              # a SHARED folder for results/checkpoints
NPROC_PER_NODE=${SLURM_GPUS_ON_NODE:-4}   # one worker per GPU: worker LOCAL_RANK uses cuda:LOCAL_RANK
PORT=${PORT:-29500}                    # rendezvous port on the head node
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)   # first node of the job
HEAD_ADDR=${HEAD_ADDR:-$(scontrol show node "$HEAD" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)}   # its address
export OMP_NUM_THREADS=4               # cores per worker (16 / 4)
# export NCCL_SOCKET_IFNAME=ib0        # NCCL's bootstrap interface (prefix match; ^docker,lo excludes)
# export NCCL_DEBUG=INFO               # print the transport NCCL picked (IB, sockets, NVLink)
# export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # with TORCHRUN_ARGS=--max-restarts=N: restarted workers must
#                                       not read the last attempt's addresses from torchrun's store (pytorch#135712)
echo "job $SLURM_JOB_ID: nodes $SLURM_JOB_NODELIST, head $HEAD ($HEAD_ADDR:$PORT), $NPROC_PER_NODE GPUs per node"

# Once per node: each torchrun agent rendezvouses on the head and starts NPROC_PER_NODE workers.
#   --kill-on-bad-exit=1  one failed node ends the whole job
#   --rdzv_id             the same on every node (the job id)
#   --backend=nccl        GPU collectives; minidist.init() checks there is a GPU per local rank
srun --kill-on-bad-exit=1 \
    "$PYTHON" -m torch.distributed.run \
        --nnodes="$SLURM_NNODES" \
        --nproc_per_node="$NPROC_PER_NODE" \
        --rdzv_backend=c10d \
        --rdzv_endpoint="$HEAD_ADDR:$PORT" \
        --rdzv_id="$SLURM_JOB_ID" \
        ${TORCHRUN_ARGS:-} \
    "$TRAIN" --out="$OUT" --ckpt="$OUT" --backend=nccl ${TRAIN_ARGS:-}
