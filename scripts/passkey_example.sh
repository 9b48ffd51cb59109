#!/bin/bash
# The passkey example of docs/context-extension.md: a 0.9M-parameter Llama learns passkey
# retrieval on CPU (2 processes, UPipe), evaluated at steps 100 and 600. Run it from the
# repository root: bash scripts/passkey_example.sh (minutes on 2 cores). The numbers of the
# doc's table are the last lines of the two evaluations.
set -euo pipefail

python scripts/make_passkey_example.py outputs/passkey_data --digits 1 --min-sentences 2 --max-sentences 14
JOB="--config train_configs/debug_model.toml --model.flavor hf --model.hf_assets_path outputs/passkey_data/model
     --training.dataset_path outputs/passkey_data/train --job.dump_folder outputs/passkey_example"
torchrun --nproc_per_node 2 train.py $JOB --training.seq_len 256 --training.local_batch_size 8 \
    --training.steps 600 --optimizer.lr 5e-3 --lr_scheduler.warmup_steps 20 \
    --checkpoint.interval 100 --checkpoint.keep_latest_k 0 --metrics.log_freq 100 \
    --metrics.enable_tensorboard false
for step in 100 600; do
  torchrun --nproc_per_node 2 -m upipe_dtensor.evaluate $JOB --checkpoint.load_step $step \
      --task passkey --digits 1 --lengths 128,256,512,1K --depths 0,0.25,0.5,0.75,1 --samples 8 \
      --haystack outputs/passkey_data/haystack.txt
done
