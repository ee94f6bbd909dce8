#!/bin/bash
# GPU measurements of the trainer (bench/train_throughput.py) for one GPU count; results in $OUT.
#
#   scripts/gpu_trainer_bench.sh 1 [config] [phase]    # phase: trainer | search | all (default all)
#   scripts/gpu_trainer_bench.sh 2 swa_gdn2_1.3B trainer
#
# Phase "trainer" (about 3-4 minutes for a 1.3B model) runs pretrain/main.py for 8 steps on synthetic
# shards, resumes it for 2 more and consolidates the checkpoint (FSDP sharded checkpoints from 2
# GPUs on); phase "search" (up to --time-budget) finds the largest micro-batch at the config's
# context with and without activation checkpointing. The package need not be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
NGPU=${1:-1}
CONFIG=${2:-swa_gdn2_1.3B}
PHASE=${3:-all}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
set -o pipefail
python bench/train_throughput.py --config "$CONFIG" --gpus "$NGPU" --phase "$PHASE" --out "$OUT" \
    --time-budget "${TIME_BUDGET:-480}" 2>&1 | tee "$OUT/train_throughput_${CONFIG}_${NGPU}gpu_${PHASE}.log"
