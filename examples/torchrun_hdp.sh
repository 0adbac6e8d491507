#!/usr/bin/env bash
# Launch HDP training with torchrun on this node (run it on every node of a multi-node job).
#
#   examples/torchrun_hdp.sh examples/models/llama3_8b_256k.sh
#   MASTER_ADDR=node0 NODE_RANK=3 DATA_PATH=/data/my_text_document examples/torchrun_hdp.sh <model file>
#   ENTRY=/path/to/Megatron-LM/pretrain_gpt.py ...   # patched pretrain_gpt.py instead of our entry
#   DRY_RUN=1 ...                                    # print the arguments, launch nothing
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/hdp_launch_lib.sh"
hdp_load_model "${1:?usage: $0 examples/models/<model>.sh}"

if [[ "${DRY_RUN:-0}" == 1 ]]; then hdp_dry_run; exit 0; fi

exec torchrun \
    --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --node-rank "${NODE_RANK:-0}" \
    --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-29500}" \
    "$ENTRY" "${SCRIPT_ARGS[@]}"
