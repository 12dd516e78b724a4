#!/bin/bash
# The runs of README.md: each stage twice, in this order. From anywhere; PYTHON (default python3) has hf_apex's
# dependencies, OUT (default /tmp/cpub) takes each run's folder and log.
cd "$(dirname "$0")/../.." || exit 1
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
PYTHON=${PYTHON:-python3} OUT=${OUT:-/tmp/cpub}
mkdir -p "$OUT"
for rep in 1 2; do
  for st in baseline torch_fused fused_adam_ln fused_full; do
    $PYTHON recipes/finetune.py --task sst2 --data_dir ../shared/data --model_type bert \
      --tokenizer_name ../shared/data/tokenizers/bert-base-uncased --stage $st --use_cpu \
      --max_steps 30 --per_device_train_batch_size 8 --max_eval_samples 32 --output_dir "$OUT/$st-$rep" \
      --save_strategy no --save_final_model false > "$OUT/$st-$rep.log" 2>&1
    echo "$st $rep rc $?"
  done
done
