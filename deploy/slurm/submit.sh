#!/bin/bash
# submit.sh [all|syncer|learners|evaluator]: submit a ddiloco run (default: all three jobs) with
# the settings of env.sh. The learner array has one element per learner, 0 .. run.num_learners-1
# of the config. Submitting one part again (a job that hit its time limit, was cancelled, or gave
# up) continues the same run: the syncer resumes from RUN_DIR/state, a learner rejoins.
#
# Partition, account, QOS: export SBATCH_PARTITION / SBATCH_ACCOUNT / SBATCH_QOS before it.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export DDILOCO_ENV="${DDILOCO_ENV:-$HERE/env.sh}"
# shellcheck disable=SC1090
source "$DDILOCO_ENV"
export DDILOCO_ENV=$(realpath "$DDILOCO_ENV")
if [ -n "$VENV" ]; then
    # shellcheck disable=SC1091
    source "$VENV/bin/activate"
fi
what="${1:-all}"
case "$what" in all | syncer | learners | evaluator) ;; *) echo "usage: $0 [all|syncer|learners|evaluator]" >&2; exit 2 ;; esac

# The jobs get absolute paths (they run in RUN_DIR/slurm), through the environment sbatch passes on.
CONFIG=$(realpath -m "$CONFIG")
RUN_DIR=$(realpath -m "$RUN_DIR")
KEYS_DIR=$(realpath -m "$KEYS_DIR")
export CONFIG RUN_DIR KEYS_DIR
[ -f "$CONFIG" ] || { echo "no config $CONFIG (CONFIG in $DDILOCO_ENV)" >&2; exit 2; }
M=$(ddiloco config "$CONFIG" | awk '/^\[/ {run = ($0 == "[run]")} run && $1 == "num_learners" {print $3; exit}')
[ -n "$M" ] || { echo "could not read run.num_learners from $CONFIG" >&2; exit 2; }

need() { [ -f "$1" ] || { echo "missing $1: run ddiloco keys $KEYS_DIR --learners $M, then $HERE/split-keys.sh" >&2; exit 2; }; }
need "$KEYS_DIR/syncer/syncer.key_secret"
need "$KEYS_DIR/observer/observer.key_secret"
for ((m = 0; m < M; m++)); do need "$KEYS_DIR/learner-$m/learner-$m.key_secret"; done

sb() {  # sbatch, or (DDILOCO_DRY_RUN=FILE) the command written to FILE
    if [ -n "${DDILOCO_DRY_RUN:-}" ]; then
        printf '%q ' sbatch "$@" >>"$DDILOCO_DRY_RUN"
        printf '\n' >>"$DDILOCO_DRY_RUN"
        echo 0
    else
        sbatch --parsable "$@"
    fi
}
if [ -z "${DDILOCO_DRY_RUN:-}" ]; then mkdir -p "$RUN_DIR/slurm"; fi
common=(--chdir "$RUN_DIR/slurm" --open-mode append --requeue)

if [ "$what" = all ] || [ "$what" = syncer ]; then
    id=$(sb "${common[@]}" --job-name ddiloco-syncer --output "$RUN_DIR/slurm/%x-%j.out" \
        --cpus-per-task "$SYNCER_CPUS" ${SYNCER_TIME:+--time "$SYNCER_TIME"} "$HERE/syncer.sbatch")
    echo "syncer: job $id"
fi
if [ "$what" = all ] || [ "$what" = learners ]; then
    gpus=()
    if [ "$LEARNER_GPUS_PER_NODE" -gt 0 ]; then gpus=(--gpus-per-node "$LEARNER_GPUS_PER_NODE"); fi
    id=$(sb "${common[@]}" --job-name ddiloco-learner --output "$RUN_DIR/slurm/%x-%A_%a.out" \
        --array "0-$((M - 1))" --nodes "$LEARNER_NODES" --ntasks-per-node 1 \
        --cpus-per-task "$LEARNER_CPUS_PER_TASK" "${gpus[@]}" ${LEARNER_TIME:+--time "$LEARNER_TIME"} \
        "$HERE/learners.sbatch")
    echo "learners: job array $id (0-$((M - 1)))"
fi
if [ "$what" = all ] || [ "$what" = evaluator ]; then
    id=$(sb "${common[@]}" --job-name ddiloco-evaluator --output "$RUN_DIR/slurm/%x-%j.out" \
        --cpus-per-task "$EVALUATOR_CPUS" ${EVALUATOR_TIME:+--time "$EVALUATOR_TIME"} "$HERE/evaluator.sbatch")
    echo "evaluator: job $id"
fi
echo "output: $RUN_DIR/slurm/ (squeue --me; ddiloco status \$(cat $RUN_DIR/slurm/syncer.address) --keys $KEYS_DIR/observer)"
