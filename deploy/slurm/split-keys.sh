#!/bin/bash
# split-keys.sh [KEYS_DIR]: after `ddiloco keys KEYS_DIR --learners M`, give every job its own
# key folder (KEYS_DIR defaults to env.sh's):
#   KEYS_DIR/syncer      syncer.key_secret and every public *.key  (the syncer job)
#   KEYS_DIR/learner-m   syncer.key and learner-m.key_secret       (learner m's array element only)
#   KEYS_DIR/observer    syncer.key and observer.key_secret        (the evaluator, `ddiloco status`)
# Secrets stay mode 0600, folders 0700. Every job of a user can read every file of that user, so
# this separation is what each job is given, not a wall: on a real cluster place learner-m where
# only learner m's nodes see it, or keep the top folder readable by you alone (see docs/security.md).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck disable=SC1091
source "${DDILOCO_ENV:-$HERE/env.sh}"
KEYS_DIR="${1:-$KEYS_DIR}"
cd "$KEYS_DIR"
[ -f syncer.key_secret ] || { echo "no $KEYS_DIR/syncer.key_secret: run ddiloco keys $KEYS_DIR --learners M first" >&2; exit 2; }
umask 077
mkdir -p syncer observer
cp -p syncer.key_secret syncer.key syncer/
for key in *.key; do cp -p "$key" syncer/; done
cp -p syncer.key observer.key_secret observer/
n=0
for secret in learner-*.key_secret; do
    name=${secret%.key_secret}
    mkdir -p "$name"
    cp -p syncer.key "$secret" "$name/"
    n=$((n + 1))
done
echo "key folders in $KEYS_DIR: syncer, observer and $n learner-m folders (learner-m holds syncer.key and learner-m.key_secret only)"
