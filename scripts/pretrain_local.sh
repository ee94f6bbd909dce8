#!/bin/bash
# Pretrain on the GPUs of one machine (FSDP across them), resuming automatically.
#
#   scripts/pretrain_local.sh swa_gdn2_400M                     # every visible GPU
#   NGPU=2 scripts/pretrain_local.sh swa_gdn2_1.3B --train.max_wall_time 23:50:00
#
# Extra arguments are passed to pretrain/main.py. Ctrl-C (or SIGTERM) saves a checkpoint after the
# current step; running the same command again continues from it.
set -euo pipefail
CONFIG=${1:?usage: scripts/pretrain_local.sh CONFIG [--section.key value ...]}
shift
cd "$(dirname "$0")/.."
NGPU=${NGPU:-$(python -c "import torch; print(torch.cuda.device_count())")}
if [ "$NGPU" -lt 1 ]; then
    echo "no GPU found: on a CPU run python pretrain/main.py --config $CONFIG directly" >&2
    exit 1
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export PYTHONUNBUFFERED=1
exec torchrun --standalone --nproc_per_node="$NGPU" pretrain/main.py \
    --config "$CONFIG" --resume auto "$@"
