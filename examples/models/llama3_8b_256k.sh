# Llama-3-8B, documents up to 256K tokens, 8 nodes x 8 H100-80GB (64 GPUs): TP 2, PP 1 -> HDP pool of 32 ranks.
#
# Capacity: a rank (one TP pair) keeps ~2.69 MB of bf16 activations per token over the 32 layers
# (megatron_hdp.plan.cost.presets: 2*(6h + 2kv + 4ffn)/TP bytes per token per layer, flash attention, sequence
# parallel). Model state per GPU is ~25.6 GB (8.0B params / TP2 x 6 B, + 12 B/param of Adam state over
# DP 32, distributed optimizer), leaving ~46 GB of 90% of 80 GB: at most ~17K tokens. --hdp-capacity 16384:
# a 256K document is split over a ring of 16 ranks (fewer with offloading); short documents stay whole.
# Calibrate on your cluster (`megatron-hdp calibrate`) and pass --hdp-cost-model for measured times.
NNODES=8
GPUS_PER_NODE=8
MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm
    --position-embedding-type rope --rotary-base 500000 --disable-bias-linear
    --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0
    # the longest document piece (= context): documents are sequences, longer ones cut into pieces this long
    --seq-length 262144 --max-position-embeddings 262144
    --tokenizer-type NullTokenizer --vocab-size 128256 --bf16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1
    --use-distributed-optimizer --overlap-grad-reduce
)
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 32 --train-iters 1000 --lr 3e-4 --min-lr 3e-5
    --lr-decay-style cosine --lr-warmup-iters 50 --weight-decay 0.1 --clip-grad 1.0
    --log-interval 1 --eval-iters 0 --eval-interval 1000
)
HDP_ARGS=(
    --hdp --calculate-per-token-loss --hdp-capacity 16384 --hdp-policy balance
    --hdp-offload --hdp-max-offload-ratio 1.0 --hdp-global-batch-tokens 4194304 --hdp-log-interval 10
)
