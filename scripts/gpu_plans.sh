#!/usr/bin/env bash
# The plans scripts/gpu_evidence.sh compares its measurements with, made here before a GPU lease
# so the lent minutes go to measuring (each 8B plan takes about a minute of CPU): the stand-in
# recipes, with the attention backend torch 2.11 runs on a Hopper GPU without flash-attn or FA3
# (cudnn: `auto` takes it after the probe), priced for both GPUs the device tool lends. The stand-in
# uses a plan only when it matches the job it runs (seq_len, ranks, backend, compiled, GPU
# profile) and plans on the machine otherwise. Carry the folder: carry [".whl", ".gpu_plans"].
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
mkdir -p .gpu_plans
commit="$(git rev-parse HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)')"
for recipe in llama3_8b_128K llama3_8b_256K; do
    for gpu in h100-sxm h200; do
        echo "planning $recipe for $gpu" >&2
        "$python" -m upipe_dtensor.plan --config "recipes/$recipe.toml" --gpu "$gpu" \
            --parallelism.attention_backend cudnn --json >".gpu_plans/$recipe.cudnn.$gpu.json"
    done
done
echo "$commit" >.gpu_plans/commit.txt  # the tree the plans were made from
ls -l .gpu_plans
