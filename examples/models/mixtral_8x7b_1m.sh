# Mixtral-8x7B (8 experts, top-2), documents up to 1M tokens, 64 nodes x 8 H100-80GB (512 GPUs):
# TP 4, PP 1, EP 8 (experts sharded over 8 of the 128 data-parallel ranks) -> HDP pool of 128.
#
# Capacity: ~2.26 MB of activations per token per TP4 rank over 32 layers (top-2 experts count twice in
# the MLP term). Model state per GPU ~11 GB (attention/embeddings / TP4, experts / (TP4 x EP8), Adam state
# over DP 128), leaving ~61 GB: at most ~27K tokens. --hdp-capacity 24576 (a multiple of TP 4 for sequence
# parallelism): a 1M document spans ~43 ranks. Ranks of one EP group exchange tokens in every MoE layer,
# so the 8 ranks of an EP group must run the same number of micro-batches (docs/architecture.md, constraints):
# the balance planner plans each EP group as one unit (docs/cost_model.md). `megatron-hdp simulate --model
# mixtral-8x7b --gpus 512 --tp 4 --ep 8` prints this arithmetic (it keeps C at a power of two, 16K).
NNODES=64
GPUS_PER_NODE=8
MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --swiglu --normalization RMSNorm
    --position-embedding-type rope --rotary-base 1000000 --disable-bias-linear
    --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0
    --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm
    # the longest document piece (= context): documents are sequences, longer ones cut into pieces this long
    --seq-length 1048576 --max-position-embeddings 1048576
    --tokenizer-type NullTokenizer --vocab-size 32000 --bf16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 1
    --expert-model-parallel-size 8 --use-distributed-optimizer --overlap-grad-reduce
)
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 128 --train-iters 1000 --lr 1e-4 --min-lr 1e-5
    --lr-decay-style cosine --lr-warmup-iters 50 --weight-decay 0.1 --clip-grad 1.0
    --log-interval 1 --eval-iters 0 --eval-interval 1000
)
HDP_ARGS=(
    --hdp --calculate-per-token-loss --hdp-capacity 24576 --hdp-policy balance
    --hdp-offload --hdp-max-offload-ratio 1.0 --hdp-global-batch-tokens 16777216 --hdp-log-interval 10
)
