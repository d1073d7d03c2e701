#!/bin/bash
# (a) One task per node; torchrun starts the worker processes on each node.  CPU / gloo variant.
#     sbatch course/multinode/sbatch_torchrun_cpu.sh          (from the repository root)
#SBATCH --job-name=minidist-torchrun   # the name squeue shows; %x in --output below
#SBATCH --nodes=2                      # two machines
#SBATCH --ntasks-per-node=1            # ONE task per node: torchrun itself starts the workers (never more: srun x torchrun)
#SBATCH --cpus-per-task=2              # the cores torchrun's workers share on each node
#SBATCH --time=00:10:00                # wall-clock limit; Slurm kills the job after it
#SBATCH --output=%x-%j.out             # stdout+stderr of the batch script: job name and job id

set -euo pipefail                      # stop at the first failing command
# The batch script runs on the first node of the allocation. Slurm copies this file into its spool
# folder, so find the course through the submission folder, not through $0.
PYTHON=${PYTHON:-python3}              # the interpreter with torch and minidist (a venv path works)
TRAIN=${TRAIN:-$SLURM_SUBMIT_DIR/course/multinode/train.py}   # the script every worker runs
OUT=${OUT:-$SLURM_SUBMIT_DIR/runs/$SLURM_JOB_ID}              # a SHARED folder: every node writes here
NPROC_PER_NODE=${NPROC_PER_NODE:-2}    # workers per node (on GPUs: the GPUs per node)
PORT=${PORT:-29500}                    # rendezvous port on the head node; must be free there
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)   # first node of the job, e.g. node1
# The address other nodes reach the head at, as Slurm knows it (on most clusters the hostname itself);
# an exported HEAD_ADDR wins (the local cluster's loopback fallback passes the machine's hostname).
HEAD_ADDR=${HEAD_ADDR:-$(scontrol show node "$HEAD" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)}
export OMP_NUM_THREADS=1               # one intra-op thread per worker: workers share the cores
# export GLOO_SOCKET_IFNAME=eth0       # the interface between nodes, if the hostname's is wrong (same name on every node)
# export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # with TORCHRUN_ARGS=--max-restarts=N: restarted workers must
#                                       not read the last attempt's addresses from torchrun's store (pytorch#135712)
echo "job $SLURM_JOB_ID: nodes $SLURM_JOB_NODELIST, head $HEAD ($HEAD_ADDR:$PORT), $NPROC_PER_NODE workers per node"

# srun starts this line once per node (--ntasks-per-node=1). Each torchrun agent meets the others
# through c10d rendezvous on the head; torchrun hands out RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK,
# MASTER_ADDR and MASTER_PORT, which minidist.init() reads. Global rank 0 may land on ANY node.
#   --kill-on-bad-exit=1  one failed node ends the whole job instead of leaving the others waiting
#   --nnodes              how many agents to wait for at the rendezvous
#   --rdzv_id             the same on every node (the job id), different per job
#   TORCHRUN_ARGS / TRAIN_ARGS  extra arguments (e.g. --max-restarts=3; train.py --epochs=5)
srun --kill-on-bad-exit=1 \
    "$PYTHON" -m torch.distributed.run \
        --nnodes="$SLURM_NNODES" \
        --nproc_per_node="$NPROC_PER_NODE" \
        --rdzv_backend=c10d \
        --rdzv_endpoint="$HEAD_ADDR:$PORT" \
        --rdzv_id="$SLURM_JOB_ID" \
        ${TORCHRUN_ARGS:-} \
    "$TRAIN" --out="$OUT" --ckpt="$OUT" --backend=gloo ${TRAIN_ARGS:-}
