# LLaMA-70B, documents up to 512K tokens, 128 nodes x 8 H100-80GB (1024 GPUs): TP 8, PP 4 -> HDP pool of 32.
#
# Capacity: with 1F1B the first stage keeps PP micro-batches of 80/PP layers in flight, i.e. the
# activations of all 80 layers for one micro-batch: ~3.32 MB per token per TP8 rank. Model state per GPU
# is ~13.7 GB (69B params / (TP8 x PP4) x 6 B, + Adam state over DP 32), leaving ~58 GB: at most ~17.5K
# tokens. --hdp-capacity 16384: the pool holds 32 x 16K = 512K tokens, so the longest document spans the
# whole pool without offloading and fewer ranks with it; offloading is what keeps the rest busy.
NNODES=128
GPUS_PER_NODE=8
MODEL_ARGS=(
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64
    --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm
    --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0.0 --hidden-dropout 0.0
    # the longest document piece (= context): documents are sequences, longer ones cut into pieces this long
    --seq-length 524288 --max-position-embeddings 524288
    --tokenizer-type NullTokenizer --vocab-size 32000 --bf16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 4
    --use-distributed-optimizer --overlap-grad-reduce
)
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 32 --train-iters 1000 --lr 1.5e-4 --min-lr 1.5e-5
    --lr-decay-style cosine --lr-warmup-iters 50 --weight-decay 0.1 --clip-grad 1.0
    --log-interval 1 --eval-iters 0 --eval-interval 1000
)
HDP_ARGS=(
    --hdp --calculate-per-token-loss --hdp-capacity 16384 --hdp-policy balance
    --hdp-offload --hdp-max-offload-ratio 1.0 --hdp-global-batch-tokens 8388608 --hdp-log-interval 10
)
