# Shared by torchrun_hdp.sh and sbatch_hdp.sh: read a model file, compose the training command.
#
# A model file (examples/models/*.sh) sets NNODES, GPUS_PER_NODE and the arrays MODEL_ARGS,
# PARALLEL_ARGS, TRAIN_ARGS, HDP_ARGS. DATA_ARGS come from $DATA_PATH (a Megatron indexed dataset
# prefix: HDP plans its documents, each one sequence, cut into pieces of at most --seq-length) or, when
# unset, variable-length mock documents drawn from the length mix HDP_MOCK_MIX (--hdp-mock-mix; default
# byted, the ByteScale paper's long-tailed mix). ENTRY is the training script: our
# examples/pretrain_gpt_hdp.py by default, or Megatron-LM's patched pretrain_gpt.py.
# With DRY_RUN=1 the launchers print the environment and the script's arguments, one per line, instead
# of launching (tests/commands/test_examples.py parses them with Megatron's parser).

hdp_load_model() {
    local model_file="$1"
    if [[ ! -f "$model_file" ]]; then
        echo "error: model file $model_file not found (see examples/models/)" >&2
        exit 2
    fi
    # shellcheck source=/dev/null
    source "$model_file"
    export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP/SP communication overlap needs one hardware queue (Megatron checks it)
    if [[ -n "${DATA_PATH:-}" ]]; then
        DATA_ARGS=(--data-path "$DATA_PATH" --split 99,1,0)
    else
        DATA_ARGS=(--mock-data --hdp-mock-mix "${HDP_MOCK_MIX:-byted}")
    fi
    ENTRY="${ENTRY:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/pretrain_gpt_hdp.py}"
    SCRIPT_ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" "${HDP_ARGS[@]}")
}

hdp_dry_run() {
    echo "env CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS"
    echo "world_size $((NNODES * GPUS_PER_NODE))"
    printf 'arg %s\n' "${SCRIPT_ARGS[@]}"
}
