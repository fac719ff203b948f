# deploy/slurm/lib.sh: shell functions the *.sbatch jobs share (sourced after env.sh). Nothing to
# edit here; the settings are in env.sh.
#
# DDILOCO_DRY_RUN=FILE (used by tests/test_deploy_slurm.py): every command a job would start is
# written to FILE, one line each (shell-quoted), instead of being run, and nothing is written
# under RUN_DIR.

ddl_log() {  # a timestamped line in the job's output, the same clock as ddiloco's own lines
    echo "$(date '+%F %T') slurm job ${SLURM_JOB_ID:-?}${SLURM_ARRAY_TASK_ID:+ (array task $SLURM_ARRAY_TASK_ID)} on $(hostname -s): $*" >&2
}

ddl_setup() {  # activate the environment and check what every job needs
    if [ -n "$VENV" ]; then
        # shellcheck disable=SC1091
        source "$VENV/bin/activate"
    fi
    export PYTHONUNBUFFERED=1
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # torch threads come from --threads / run.threads
    ADDRESS_FILE="$RUN_DIR/slurm/syncer.address"
    if [ -z "$DDILOCO_DRY_RUN" ]; then
        mkdir -p "$RUN_DIR/slurm"
    fi
    STOPPING=""
    CHILD=""
    trap ddl_on_signal TERM INT
    ddl_log "$1 starting (restart count ${SLURM_RESTART_COUNT:-0}): config $CONFIG, run dir $RUN_DIR"
}

ddl_on_signal() {  # Slurm stops, cancels or requeues the job: stop the process cleanly, do not restart it
    STOPPING=1
    ddl_log "signal received: ${CHILD:+process $CHILD stops cleanly (ddiloco writes what was done); }not restarting it"
    # Slurm signals every process of the job itself; pass the signal on only to a process that
    # is still there 5 s later (a signal sent to this shell alone: scancel --batch). A second
    # signal at once would cut torchrun's own clean shutdown short.
    if [ -n "$CHILD" ]; then
        (sleep 5; kill -TERM "$CHILD" 2>/dev/null) &
    fi
}

ddl_start() {  # start "$@" in the background (CHILD), its stderr also kept in CHILD_ERR
    if [ -n "$DDILOCO_DRY_RUN" ]; then
        printf '%q ' "$@" >>"$DDILOCO_DRY_RUN"
        printf '\n' >>"$DDILOCO_DRY_RUN"
        CHILD=""
        return 0
    fi
    CHILD_ERR="$RUN_DIR/slurm/.stderr-${SLURM_JOB_ID:-$$}"
    : >"$CHILD_ERR"
    # tee ignores the job's SIGTERM so that the process's last lines (its clean stop) still get out
    "$@" 2> >(trap '' TERM INT; exec tee -a "$CHILD_ERR" >&2) &
    CHILD=$!
    ddl_log "started pid $CHILD: $*"
}

ddl_wait() {  # wait for CHILD; its exit status in RC (a signal to this job does not cut the wait short)
    RC=0
    if [ -z "$CHILD" ]; then
        return 0
    fi
    wait "$CHILD"
    RC=$?
    while kill -0 "$CHILD" 2>/dev/null; do  # the wait was interrupted by a trapped signal
        wait "$CHILD"
        RC=$?
    done
    CHILD=""
}

ddl_rank0_code() {  # torchrun exits 1 whatever its ranks did: read rank 0's own exit code from its report
    local code
    code=$(awk '/^ *rank *: 0 \(/ {r = 1; next} r && /exitcode *:/ {sub(/.*exitcode *: */, ""); sub(/ .*/, ""); print; exit}' "$CHILD_ERR" 2>/dev/null)
    echo "${code:-$RC}"
}

ddl_run_ended() {  # true once the syncer has written the summary of an ended (not interrupted) run
    [ -f "$RUN_DIR/summary.json" ] || return 1
    python - "$RUN_DIR/summary.json" <<'EOF'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(1)
sys.exit(0 if s.get("ended_by") and not s.get("partial") else 1)
EOF
}

ddl_syncer_address() {  # print the syncer's address: SYNCER_ADDR, else wait for the syncer job's file
    if [ -n "$SYNCER_ADDR" ]; then
        echo "$SYNCER_ADDR"
        return 0
    fi
    local said=""
    while [ ! -s "$ADDRESS_FILE" ]; do
        if [ -n "$STOPPING" ] || ddl_run_ended; then
            return 1
        fi
        if [ -z "$said" ]; then
            ddl_log "waiting for the syncer job to write $ADDRESS_FILE"
            said=1
        fi
        sleep 5
    done
    cat "$ADDRESS_FILE"
}

ddl_watch_address() {  # background: stop CHILD (to be restarted) if the syncer's address changes
    local started_with="$1" pid="$2" now
    [ -n "$SYNCER_ADDR" ] && return 0
    while kill -0 "$pid" 2>/dev/null; do
        sleep 10
        now=$(cat "$ADDRESS_FILE" 2>/dev/null)
        if [ -n "$now" ] && [ "$now" != "$started_with" ]; then
            ddl_log "the syncer moved to $now (was $started_with): restarting the learner there"
            kill -TERM "$pid" 2>/dev/null
            return 0
        fi
    done
}

ddl_stop_if_asked() {  # a signal came while nothing ran (a backoff, a wait): start nothing new
    if [ -n "$STOPPING" ]; then
        ddl_log "stopping on the signal: nothing started again"
        exit 130
    fi
}

ddl_backoff() {  # sleep before restart number $1: 5 s, 10 s, 20 s ... at most 5 min
    local n="$1" s="${RESTART_BACKOFF_S:-5}"
    while [ "$n" -gt 1 ] && [ "$s" -lt 300 ]; do
        s=$((s * 2))
        n=$((n - 1))
    done
    [ "$s" -gt 300 ] && s=300
    [ -n "$DDILOCO_DRY_RUN" ] && return 0
    sleep "$s" &
    wait $! 2>/dev/null
}
