# TEST RIG ONLY: the settings of the single-node rehearsal (docs/results/slurm_single_node.md):
# CPU learners of 2 ranks each, 1-2 CPUs a job, everything under /tmp/ddiloco-slurm (one
# machine: its local disk stands in for shared storage). The rest comes from ../env.sh.
# Use: DDILOCO_ENV=deploy/slurm/single-node/env.sh deploy/slurm/submit.sh
RIG="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
: "${CONFIG:=$RIG/tiny.toml}"
: "${RUN_DIR:=/tmp/ddiloco-slurm/run}"
: "${KEYS_DIR:=/tmp/ddiloco-slurm/keys}"
: "${VENV:=$(cd "$RIG/../../.." && pwd)/.venv}"
: "${LEARNER_GPUS_PER_NODE:=0}"
: "${LEARNER_RANKS_PER_NODE:=2}"
: "${LEARNER_CPUS_PER_TASK:=2}"
: "${LEARNER_DEVICE:=cpu}"
: "${LEARNER_THREADS:=1}"
: "${SYNCER_CPUS:=1}"
: "${EVALUATOR_CPUS:=1}"
# shellcheck disable=SC1091
source "$RIG/../env.sh"
