#!/usr/bin/env bash
# SLURM: one torchrun per node, all nodes of the allocation.
#
#   MODEL=examples/models/llama_70b_512k.sh sbatch --nodes 128 examples/sbatch_hdp.sh
#   (--nodes must equal the model file's NNODES; DATA_PATH, ENTRY, DRY_RUN as in torchrun_hdp.sh)
#SBATCH --job-name=megatron-hdp
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
set -euo pipefail
here="${SLURM_SUBMIT_DIR:-$(pwd)}/examples"
source "$here/hdp_launch_lib.sh"
hdp_load_model "${MODEL:?set MODEL=examples/models/<model>.sh}"

if [[ "${DRY_RUN:-0}" == 1 ]]; then hdp_dry_run; exit 0; fi

if [[ "${SLURM_NNODES:-}" != "$NNODES" ]]; then
    echo "error: the allocation has ${SLURM_NNODES:-no} nodes, $MODEL wants NNODES=$NNODES (sbatch --nodes $NNODES)" >&2
    exit 2
fi
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
srun --kill-on-bad-exit=1 bash -c "torchrun \
    --nnodes $NNODES --nproc-per-node $GPUS_PER_NODE --node-rank \$SLURM_NODEID \
    --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:${MASTER_PORT:-29500} --rdzv-id $SLURM_JOB_ID \
    $ENTRY ${SCRIPT_ARGS[*]@Q}"
