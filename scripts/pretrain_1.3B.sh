#!/bin/bash
# Pretrain a 1.3B model (default: the GDN-2 / sliding-window hybrid) with SLURM, FSDP and auto-resume.
#
#   mkdir -p logs && sbatch scripts/pretrain_1.3B.sh        # from the repository root: swa_gdn2_1.3B, 4 x 8 GPUs
#   CONFIG=gdn2_1.3B sbatch --nodes=8 scripts/pretrain_1.3B.sh --train.micro_batch_size 2
#
# One task per GPU (srun starts them; Fabric reads the SLURM variables). Two minutes before the time
# limit SLURM sends SIGUSR1: the trainer finishes its step, saves a checkpoint and requeues the job
# (scontrol requeue), which starts again with --resume auto from that checkpoint. Extra arguments are
# passed to pretrain/main.py. The global batch is 128 x 4096 tokens: 128 must be a multiple of
# micro_batch_size x GPUs (4 x 32 on 4 nodes; use --train.micro_batch_size 1 on 32 nodes).
#SBATCH --job-name=gdn2-1.3B
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out

set -euo pipefail
CONFIG=${CONFIG:-swa_gdn2_1.3B}
OUT_DIR=${OUT_DIR:-out/${CONFIG}}
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
mkdir -p logs "$OUT_DIR"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1  # a failed collective ends the job instead of hanging it
export PYTHONUNBUFFERED=1

echo "job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NUM_NODES} node(s): ${SLURM_JOB_NODELIST}"
srun --kill-on-bad-exit=1 python pretrain/main.py \
    --config "$CONFIG" \
    --out_dir "$OUT_DIR" \
    --resume auto \
    "$@"
