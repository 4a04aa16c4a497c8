#!/usr/bin/env bash
# Launch titanrl on this machine: NGPU ranks (processes), CONFIG_FILE, extra --section.key=value args.
#   NGPU=2 CONFIG_FILE=train_configs/grpo_reverse_debug.toml ./scripts/run_train.sh --training.steps=10
set -euo pipefail
NGPU=${NGPU:-1}
CONFIG_FILE=${CONFIG_FILE:-train_configs/grpo_reverse_debug.toml}
# One CPU thread per rank unless told otherwise: ranks share the cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}
exec titanrl run --nproc "$NGPU" "$CONFIG_FILE" "$@"
