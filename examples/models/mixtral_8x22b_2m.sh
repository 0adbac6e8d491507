# Mixtral-8x22B (8 experts, top-2), documents up to 2M tokens, 512 nodes x 8 H100-80GB (4096 GPUs):
# TP 8, PP 4, EP 8 -> HDP pool of 128 ranks.
#
# Capacity: ~2.38 MB of activations per token per TP8 rank over 56 layers (1F1B: the first stage holds
# all layers' worth). Model state per GPU ~4.2 GB (141B params over TP8 x PP4, experts also over EP8, Adam
# state over DP 128), leaving ~68 GB: at most ~28K tokens. --hdp-capacity 24576: the pool holds 3M tokens,
# a 2M document spans ~86 ranks without offloading, fewer with it.
NNODES=512
GPUS_PER_NODE=8
MODEL_ARGS=(
    --num-layers 56 --hidden-size 6144 --ffn-hidden-size 16384 --num-attention-heads 48
    --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm
    --position-embedding-type rope --rotary-base 1000000 --disable-bias-linear
    --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0
    --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm
    # the longest document piece (= context): documents are sequences, longer ones cut into pieces this long
    --seq-length 2097152 --max-position-embeddings 2097152
    --tokenizer-type NullTokenizer --vocab-size 32768 --bf16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 4
    --expert-model-parallel-size 8 --use-distributed-optimizer --overlap-grad-reduce
)
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 128 --train-iters 1000 --lr 1e-4 --min-lr 1e-5
    --lr-decay-style cosine --lr-warmup-iters 50 --weight-decay 0.1 --clip-grad 1.0
    --log-interval 1 --eval-iters 0 --eval-interval 1000
)
HDP_ARGS=(
    --hdp --calculate-per-token-loss --hdp-capacity 24576 --hdp-policy balance
    --hdp-offload --hdp-max-offload-ratio 1.0 --hdp-global-batch-tokens 33554432 --hdp-log-interval 10
)
