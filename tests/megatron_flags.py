"""The smallest Megatron-LM command line the flag tests parse (`TINY`) and the flags every --hdp run adds
(`HDP`): shared by the tests of flags, of attention options and of the cost model's recompute."""

TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
    "--micro-batch-size 1 --global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128 --attention-dropout 0.0"
).split()
HDP = ["--hdp", "--calculate-per-token-loss"]
