# deploy/slurm/env.sh: the one file to edit for a ddiloco run on Slurm.
#
# submit.sh and every *.sbatch job source this file (a job finds it through DDILOCO_ENV, which
# submit.sh sets to this file's absolute path; without it, $SLURM_SUBMIT_DIR/env.sh). Every value
# below can also be set in the environment instead (VAR=... ./submit.sh): the form
# `: "${VAR:=default}"` keeps a value that is already set.
#
# Paths must be readable from every node that runs a job: shared storage (NFS, Lustre, GPFS...).
#
# A variant (another run, the test rig in single-node/env.sh) can set some values and then
# source this file for the rest; point submit.sh at it with DDILOCO_ENV=path/to/it.

# Where the scripts are (not a setting): lib.sh and the *.sbatch files sit next to this file.
DDILOCO_DEPLOY_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# --- the run --------------------------------------------------------------------------------
# The config every process of the run uses (syncer, learners, evaluator: the same file).
# run.num_learners in it is the size of the learner array (submit.sh reads it from there).
: "${CONFIG:=/shared/ddiloco/exp1.toml}"

# The run folder, on shared storage. The syncer's durable store lives in RUN_DIR/state: a
# syncer (re)started on the same RUN_DIR resumes the run from it (a requeue, a crash, a new
# sbatch), so never delete RUN_DIR/state of a run you want to continue. The learners and the
# evaluator write their status and metrics into the same folder; the jobs' Slurm output files
# and the syncer's address go to RUN_DIR/slurm/.
: "${RUN_DIR:=/shared/ddiloco/runs/exp1}"

# The keys folder made by `ddiloco keys KEYS_DIR --learners M` and split by split-keys.sh into
# KEYS_DIR/syncer, KEYS_DIR/learner-M (one per learner) and KEYS_DIR/observer. Each job reads
# only its own subfolder.
: "${KEYS_DIR:=/shared/ddiloco/keys/exp1}"

# --- the syncer's address -------------------------------------------------------------------
# The syncer binds tcp://0.0.0.0:SYNCER_PORT on whatever node Slurm gives it, and writes
# tcp://SYNCER_HOST:SYNCER_PORT to RUN_DIR/slurm/syncer.address once it is up; the learners and
# the evaluator wait for that file, and a learner restarts itself when the address changes (the
# syncer requeued onto another node). SYNCER_HOST defaults to the syncer node's `hostname -f`;
# set it when the nodes reach each other under other names (an interface, a DNS alias).
# To pin the address instead (a syncer on a fixed service node, started by hand or with
# sbatch --nodelist), set SYNCER_ADDR=tcp://HOST:PORT: then no file is read or written.
: "${SYNCER_PORT:=5555}"
: "${SYNCER_HOST:=}"
: "${SYNCER_ADDR:=}"

# --- resources ------------------------------------------------------------------------------
# One learner = one array element = LEARNER_NODES nodes with LEARNER_GPUS_PER_NODE GPUs each,
# running one torchrun group of LEARNER_NODES x LEARNER_RANKS_PER_NODE ranks (DDP inside it;
# rank 0 talks to the syncer). 0 GPUs: CPU learners (no --gpus request). One node with one rank
# runs `python -m ddiloco learner` without torchrun.
: "${LEARNER_NODES:=1}"
: "${LEARNER_GPUS_PER_NODE:=8}"
: "${LEARNER_RANKS_PER_NODE:=$LEARNER_GPUS_PER_NODE}"
: "${LEARNER_CPUS_PER_TASK:=32}"
: "${LEARNER_DEVICE:=auto}"   # auto: cuda when the node has it; cpu; cuda
: "${LEARNER_THREADS:=0}"     # torch threads per rank; 0: the config's run.threads
: "${SYNCER_CPUS:=8}"         # the syncer is CPU only
: "${EVALUATOR_CPUS:=4}"
# Time limits (Slurm format, e.g. 2-00:00:00; empty: the partition's default). A job that hits
# its limit is stopped cleanly (SIGTERM); submit it again (submit.sh syncer|learners|evaluator)
# and it continues the run.
: "${SYNCER_TIME:=}"
: "${LEARNER_TIME:=}"
: "${EVALUATOR_TIME:=}"
# Partition, account, QOS: sbatch reads SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_QOS from the
# environment of submit.sh, for example:
# export SBATCH_PARTITION=gpu SBATCH_ACCOUNT=myproject

# --- software -------------------------------------------------------------------------------
# A virtual environment with ddiloco installed (its bin/ holds ddiloco, torchrun and python);
# empty: use what is on PATH (a module, a container).
: "${VENV:=}"

# How often a job restarts a learner, syncer or evaluator process that died (exit codes other
# than 0, 2, 3, 6 and 130 for a learner; see learners.sbatch) before the job gives up.
: "${MAX_RESTARTS:=20}"
