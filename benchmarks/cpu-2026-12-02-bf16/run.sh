cd /work/main
export HF_HUB_OFFLINE=1 PYTHONPATH=/work/main
for rep in 1 2; do
for st in baseline torch_fused fused_adam_ln fused_full; do
  /tmp/nuvenv/bin/python recipes/finetune.py --task sst2 --data_dir ../shared/data --model_type bert \
    --tokenizer_name ../shared/data/tokenizers/bert-base-uncased --stage $st --use_cpu \
    --max_steps 30 --per_device_train_batch_size 8 --max_eval_samples 32 --output_dir /tmp/cpub/$st-$rep \
    --save_strategy no --save_final_model false > /tmp/cpub/$st-$rep.log 2>&1
  echo "$st $rep rc $?"
done; done
