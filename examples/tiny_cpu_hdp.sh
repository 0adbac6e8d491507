#!/usr/bin/env bash
# A tiny GPT trained with HDP on 4 CPU processes (gloo), through megatron.training.pretrain: the whole
# Megatron-LM integration end to end, no GPU needed (~1-2 minutes on 2 cores).
#
#   examples/tiny_cpu_hdp.sh            # HDP: documents of up to 64 tokens, capacity 24 -> long ones on rings
#   HDP=0 examples/tiny_cpu_hdp.sh      # the same run as plain Megatron data parallelism
#   ENTRY=/path/to/Megatron-LM/pretrain_gpt.py examples/tiny_cpu_hdp.sh   # Megatron-LM's patched script
#       (tag core_v0.19.0 or main; patches/apply.sh first, and its dataset helpers built: docs/megatron_lm.md).
#       The checkout's own megatron package is used (PYTHONPATH), so main runs on megatron-core 0.20.
# Every run goes through `python -m megatron_hdp.harness.run_pretrain` (CPU shims, gloo, Python 3.11).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
work="${WORK_DIR:-/tmp/megatron_hdp_tiny}"
prefix="$(python -c "from megatron_hdp.harness.build_dataset import build_demo_dataset as b; print(b('$work/data', num_docs=256, vocab_size=256, max_length=256))")"

hdp_args=(--hdp --hdp-capacity 24 --no-hdp-offload --hdp-log-interval 1)
if [[ "${HDP:-1}" == 0 ]]; then hdp_args=(); fi

entry="${ENTRY:-examples/pretrain_gpt_hdp.py}"
if [[ -n "${ENTRY:-}" ]]; then
    export PYTHONPATH="$(cd "$(dirname "$ENTRY")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
fi
export WORLD_SIZE=4 OMP_NUM_THREADS=1
torchrun --standalone --nproc-per-node 4 -m megatron_hdp.harness.run_pretrain "$entry" \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
    --transformer-impl local --no-gradient-accumulation-fusion --no-bias-dropout-fusion --no-rope-fusion \
    --no-masked-softmax-fusion --no-persist-layer-norm --attention-dropout 0 --hidden-dropout 0 \
    --use-cpu-initialization --distributed-backend gloo \
    --micro-batch-size 1 --global-batch-size 8 --train-iters 6 --lr 3e-3 --lr-decay-style constant \
    --calculate-per-token-loss --log-interval 1 --eval-iters 0 --eval-interval 1000 \
    --tokenizer-type NullTokenizer --vocab-size 256 --data-path "$prefix" --split 100,0,0 \
    --data-cache-path "$work/cache" --num-workers 0 --seed 1234 \
    "${hdp_args[@]}"
