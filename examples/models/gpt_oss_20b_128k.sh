# gpt-oss-20b-class MoE (openai/gpt-oss-20b's shape: 24 layers, hidden 2880, 64 query / 8 KV heads of 64
# channels, 32 experts of ffn 2880 with top-4, vocab 201088), documents up to 128K tokens, 16 nodes x 8
# H100-80GB (128 GPUs): TP 2, PP 1, EP 8 (4 experts per rank, 8 of the 64 data-parallel ranks) -> HDP pool of 64.
#
# Attention is gpt-oss's: a learnable sink per head on every layer (--softmax-type learnable: Megatron's
# core_attention.softmax_offset, added to each row's softmax after the ring's log-sum-exp merge, so the
# checkpoint keeps Megatron's keys) and a 128-token causal sliding window on every other layer
# (--window-size (128,0) --window-attn-skip-freq 2: layers 1, 3, ... windowed, as gpt-oss's layer_types
# start with sliding_attention). On a windowed layer a ring member only fetches the K/V its window sees (the
# neighbouring chunk), so long documents cost ring traffic on the full layers mostly.
# The MLP is gpt-oss's clamped GLU: quick-GELU gate x * sigmoid(1.702 x), up + 1 (--glu-linear-offset 1.0),
# fc1 clamped at 7 (--activation-func-clamp-value 7.0), with biases (Megatron's default add-bias-linear).
# Positions: plain RoPE, base 150000. gpt-oss stretches it with YaRN (factor 32 over 4096), which --hdp
# refuses (per-token positions of zigzag shards are checked for RoPE only): this trains a gpt-oss-class
# model from scratch, it does not continue the published checkpoint.
#
# Capacity: a rank (one TP pair) keeps ~1.55 MB of bf16 activations per token over the 24 layers
# (megatron_hdp.plan.cost.presets: 2*(6h + 2kv + 4ffn*top_k)/TP bytes per token per layer). Model state per GPU:
# 1.8B dense parameters (attention, embeddings) / TP 2 and 19.1B expert parameters / (TP 2 x EP 8) = 2.1B,
# x 6 B (bf16 weights, fp32 gradients) = 12.6 GB, + 12 B/param of Adam state over their data-parallel
# ranks (64 dense, 8 expert; distributed optimizer) = 2.0 GB, leaving ~57 GB of 90% of 80 GB: at most ~37K
# tokens. --hdp-capacity 32768 (a multiple of TP 2 for sequence parallelism): a 128K document spans a ring
# of 4 ranks. The 8 ranks of an EP group exchange tokens in every MoE layer, so they run the same number of
# micro-batches (docs/architecture.md, constraints); the router's load-balancing loss is computed per document.
NNODES=16
GPUS_PER_NODE=8
MODEL_ARGS=(
    --num-layers 24 --hidden-size 2880 --ffn-hidden-size 2880 --num-attention-heads 64 --kv-channels 64
    --group-query-attention --num-query-groups 8 --normalization RMSNorm --norm-epsilon 1e-5
    --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0
    --position-embedding-type rope --rotary-base 150000
    --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0
    --softmax-type learnable --window-size "(128,0)" --window-attn-skip-freq 2
    --num-experts 32 --moe-ffn-hidden-size 2880 --moe-router-topk 4
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm
    # the longest document piece (= context): documents are sequences, longer ones cut into pieces this long
    --seq-length 131072 --max-position-embeddings 131072
    --tokenizer-type NullTokenizer --vocab-size 201088 --bf16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1
    --expert-model-parallel-size 8 --use-distributed-optimizer --overlap-grad-reduce
)
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 64 --train-iters 1000 --lr 3e-4 --min-lr 3e-5
    --lr-decay-style cosine --lr-warmup-iters 50 --weight-decay 0.1 --clip-grad 1.0
    --log-interval 1 --eval-iters 0 --eval-interval 1000
)
HDP_ARGS=(
    --hdp --calculate-per-token-loss --hdp-capacity 32768 --hdp-policy balance
    --hdp-offload --hdp-max-offload-ratio 1.0 --hdp-global-batch-tokens 8388608 --hdp-log-interval 10
)
