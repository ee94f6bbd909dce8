#!/bin/bash
# Quality study: train the hybrid, the pure GDN-2 model and the transformer of one size on the same
# tokens in the same order with the same recipe, validate each at 1x, 2x and 4x its context, score it
# on the offline lm-eval tasks, then compare them (gdn2 compare: table and picture).
#
#   scripts/quality_study.sh DATA OUT [options] [-- extra trainer overrides]
#
#   DATA  a folder of shards from python -m gdn2 prepare, with its tokenizer.model beside them
#   OUT   the study folder: one run folder per model and seed, and compare/ (compare.md, .png)
#
# options (defaults in brackets):
#   --size 125M|400M        which configs: swa_gdn2_SIZE, gdn2_SIZE, transformer_SIZE  [125M]
#   --models "A B ..."      named configs instead of the three of --size
#   --seeds "S1 S2 ..."     train every model once per seed (init and data order)      [3407]
#   --tokens N              training tokens per model, rounded up to whole steps        [33554432]
#   --batch N               sequences per optimizer step                                [64]
#   --micro-batch N         sequences per forward pass (accumulation follows)          [32]
#   --lr X                  peak learning rate (10% warmup, cosine to 10%)              [1e-3]
#   --evals N               validations during training (and one at the end)           [8]
#   --tasks LIST            lm-eval tasks on the final model ('' skips lm-eval)         [gdn2_local]
#
# A model whose run folder already holds its final checkpoint is not trained again; an interrupted
# one continues from its newest checkpoint. Every run uses the configs' architecture with this
# recipe; what differs between runs is only the token mixer (and the seed).
set -euo pipefail
usage() { sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 2 ] || usage
DATA=$1 OUT=$2
shift 2
SIZE=125M MODELS="" SEEDS=3407 TOKENS=33554432 BATCH=64 MICRO=32 LR=1e-3 EVALS=8 TASKS=gdn2_local
while [ $# -gt 0 ]; do
    case $1 in
        --size) SIZE=$2; shift 2 ;;
        --models) MODELS=$2; shift 2 ;;
        --seeds) SEEDS=$2; shift 2 ;;
        --tokens) TOKENS=$2; shift 2 ;;
        --batch) BATCH=$2; shift 2 ;;
        --micro-batch) MICRO=$2; shift 2 ;;
        --lr) LR=$2; shift 2 ;;
        --evals) EVALS=$2; shift 2 ;;
        --tasks) TASKS=$2; shift 2 ;;
        --) shift; break ;;
        -h|--help) usage ;;
        *) echo "quality_study.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
[ -d "$DATA" ] || { echo "quality_study.sh: DATA $DATA is not a folder" >&2; exit 2; }
ls "$DATA"/train_*.bin >/dev/null 2>&1 || { echo "quality_study.sh: $DATA holds no train_*.bin shards" >&2; exit 2; }
ls "$DATA"/val_*.bin >/dev/null 2>&1 || { echo "quality_study.sh: $DATA holds no val_*.bin shards" >&2; exit 2; }
[ -f "$DATA/tokenizer.model" ] || [ -z "$TASKS" ] || {
    echo "quality_study.sh: $DATA/tokenizer.model is missing (needed by lm-eval; --tasks '' skips it)" >&2; exit 2; }
MODELS=${MODELS:-"swa_gdn2_$SIZE gdn2_$SIZE transformer_$SIZE"}
mkdir -p "$OUT"
DATA=$(cd "$DATA" && pwd) OUT=$(cd "$OUT" && pwd)
cd "$ROOT"
export PYTHONUNBUFFERED=1

runs=()
for seed in $SEEDS; do
    for model in $MODELS; do
        run="$OUT/${model}_seed$seed"
        runs+=("$run")
        # steps, warmup and validation interval from the tokens and the model's context
        read -r steps warmup interval final < <("$PYTHON" - "$model" "$TOKENS" "$BATCH" "$EVALS" <<'EOF'
import math, sys
sys.path.insert(0, "")
from gdn2.config import Config
model, tokens, batch, evals = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
steps = math.ceil(tokens / (batch * Config.from_name(model).block_size))
print(steps, max(1, round(0.1 * steps)), max(1, steps // max(evals, 1)), f"step-{steps:09d}")
EOF
        )
        if [ -d "$run/checkpoints/$final" ]; then
            echo "== $run: finished earlier ($final), not trained again"
            continue
        fi
        resume=()
        ls -d "$run"/checkpoints/step-* >/dev/null 2>&1 && resume=(--resume auto)
        echo "== $run: $model, seed $seed, $steps steps of $BATCH sequences"
        "$PYTHON" pretrain/main.py --config "$model" --out_dir "$run" "${resume[@]}" \
            --data.train "$DATA" --data.val "$DATA" --data.prepare_default false \
            --train.seed "$seed" --train.max_steps "$steps" --train.warmup_steps "$warmup" \
            --train.global_batch_size "$BATCH" --train.micro_batch_size "$MICRO" --train.min_lr_ratio 0.1 \
            --optimizer.lr "$LR" --optimizer.weight_decay 0.1 \
            --eval.interval "$interval" --eval.length_multipliers "[1, 2, 4]" --eval.num_batches 100000 \
            --eval.micro_batch_size 16 --eval.at_end true \
            --lm_eval.interval 0 --lm_eval.at_end "$([ -n "$TASKS" ] && echo true || echo false)" \
            --lm_eval.tasks "[${TASKS:-gdn2_local}]" --lm_eval.tokenizer "$DATA/tokenizer.model" \
            --checkpoint.interval 0 --checkpoint.keep_last 1 --logging.interval 8 "$@"
    done
done
"$PYTHON" -m gdn2 compare "${runs[@]}" --out "$OUT/compare" \
    --title "$(basename "$DATA"), $TOKENS tokens per run, batch $BATCH x context, lr $LR, seeds $SEEDS"
