# DeepSeek-V3 (671B, multi-latent attention, 256 routed experts + 1 shared, top-8), documents up to 128K
# tokens (its long-context phase: YaRN at 40x its 4K context), 512 nodes x 8 H100-80GB (4096 GPUs):
# TP 8, PP 8, EP 64 -> HDP pool of 64 ranks.
#
# Shape: DeepSeek-V3's config.json. MLA: a 1536-wide query latent, a 512-wide K/V latent with the 64-wide
# shared RoPE key, q/k head dim 128 + 64, v head dim 128 (HDP's kernels and K/V rings take V narrower than
# q and k unpadded); --qk-layernorm gives the latents their RMSNorms; YaRN (--rope-type yarn) with
# Megatron's MLA defaults for the original 4096 positions and betas 32 / 1, which are DeepSeek-V3's.
# HDP rotates every token at its position inside its document, zigzag ring shards included.
# MoE: the first 3 layers dense (--moe-layer-freq), then 256 experts of 2048 plus a shared one, sigmoid
# scores, group-limited top-8 (8 groups, top 4), top-k scaling 2.5, an expert bias (aux-loss-free
# balancing; its token counts include HDP's padding tokens, docs/moe.md). DeepSeek-V3's sequence-wise
# balance loss is Megatron's seq_aux_loss over a packed micro-batch, which depends on the plan and is
# refused under HDP; HDP's aux_loss is computed per document, i.e. per sequence, which is what
# DeepSeek-V3's loss means (with its small coefficient, 1e-4).
# Multi-token prediction: DeepSeek-V3's one MTP module (--mtp-num-layers 1: a MoE layer like the last one,
# its 2h -> h projection, the shared embedding and output layer) with its loss weight of the last 4.8T
# pre-training tokens, 0.1 (--mtp-loss-scaling-factor). Under --hdp the loader reads the token after each
# ring shard, so the shifted inputs need no message; a document's last position carries no MTP loss.
#
# Parallelism: TP 8 inside a node (16 of the 128 heads per rank; sequence parallelism), PP 8 over 61
# layers (7 on the first stage, which also holds the embedding, 8 on the six middle ones, 6 on the last,
# which holds the 129K-vocabulary output layer and the MTP module: Megatron puts it on the last stage), EP 64 with expert tensor parallelism 1 (each expert
# whole on one GPU): 256 experts / 64 = 4 per GPU and stage.
#
# Capacity: ~3 MB of activations per token per TP8 rank over all 61 layers (1F1B: the first stage holds
# all layers' worth): per layer ~20 KB of MLA (latents, up-projected q/k/v of 16 heads, attention output)
# and ~27 KB of MoE (8 routed experts' 2048-wide activations per token, over the 8 SP ranks). Model state
# per GPU ~11 GB (0.26B dense and 1.28B expert parameters: bf16 weights, fp32 gradients, the distributed
# optimizer's Adam state over DP 64 and over the expert-data-parallel 8), leaving ~65 GB: at most ~21K
# tokens. --hdp-capacity 16384: the pool holds 1M tokens; a 128K document spans 8 ranks without
# offloading, fewer with it, and its ring moves K and V of 16 heads per token and TP rank:
# 16 x (192 + 128) x 2 B = 10 KB forward. The latent ring moves the 512-wide latent and the 64-wide RoPE
# key instead, 1,152 B per token on every TP rank, and each member up-projects what it receives; the
# planner picks per ring call the faster of the two by the cost model (--hdp-ring-kind auto, the default;
# `megatron-hdp plan --model deepseek-v3 --tp 8 --ep 32 --ranks 256 --capacity 16384 --dist github`
# gives 93 of balance's 114 rings the latent ring).
# Batch: 512 sequences of up to 128K tokens (64M tokens; DeepSeek-V3's long-context phase used 480,
# rounded up here to a multiple of the data-parallel size Megatron requires), its constant LR of 7.3e-6.
NNODES=512
GPUS_PER_NODE=8
MODEL_ARGS=(
    --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
    --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
    --v-head-dim 128 --qk-layernorm --rope-type yarn --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
    --position-embedding-type rope --rotary-base 10000 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0
    --num-experts 256 --moe-layer-freq "([0]*3+[1]*58)" --moe-ffn-hidden-size 2048
    --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-router-num-groups 8
    --moe-router-group-topk 4 --moe-router-score-function sigmoid --moe-router-topk-scaling-factor 2.5
    --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-4
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
    # the longest document piece (= context): documents are sequences, longer ones cut into pieces this long
    --seq-length 131072 --max-position-embeddings 163840
    --tokenizer-type NullTokenizer --vocab-size 129280 --bf16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 8
    --decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 6
    --expert-model-parallel-size 64 --expert-tensor-parallel-size 1
    --use-distributed-optimizer --overlap-grad-reduce
)
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 512 --train-iters 1000 --lr 7.3e-6 --min-lr 7.3e-6
    --lr-decay-style constant --lr-warmup-iters 0 --weight-decay 0.1 --clip-grad 1.0
    --log-interval 1 --eval-iters 0 --eval-interval 1000
)
HDP_ARGS=(
    --hdp --calculate-per-token-loss --hdp-capacity 16384 --hdp-policy balance
    --hdp-offload --hdp-max-offload-ratio 1.0 --hdp-global-batch-tokens 67108864 --hdp-log-interval 10
)
