#!/usr/bin/env bash
# Stop the single-node SLURM cluster started by tools/slurm/start.sh.
#
# Cancels the remaining jobs, then stops slurmd, slurmctld, slurmdbd, the
# private MariaDB and (only if start.sh started it) munged -- each by the
# process id in its pid file, never by name.
#
#   tools/slurm/stop.sh           stop the daemons; keep configs, database, logs
#   tools/slurm/stop.sh --purge   also delete $MLEM_SLURM_DIR and the /etc/slurm
#                                 files start.sh wrote (the packages stay)
set -euo pipefail

DIR=${MLEM_SLURM_DIR:-/var/lib/mlem-slurm}
ETC=/etc/slurm
MARK="# Managed by mlem tools/slurm/start.sh (single-node test cluster)."
purge=0
case ${1:-} in
    --purge) purge=1 ;;
    "") ;;
    *) echo "usage: $0 [--purge]" >&2; exit 2 ;;
esac

log() { printf 'slurm-stop: %s\n' "$*" >&2; }

# stop_pidfile NAME FILE: SIGTERM the process in FILE, wait up to 20 s, then SIGKILL.
stop_pidfile() {
    local name=$1 file=$2 pid i
    [[ -s $file ]] || return 0
    pid=$(cat "$file")
    if kill -0 "$pid" 2>/dev/null; then
        log "stopping $name (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 20; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 1
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "$name did not stop; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$file"
}

if [[ -s $DIR/run/slurmctld.pid ]] && command -v scancel >/dev/null \
    && kill -0 "$(cat "$DIR/run/slurmctld.pid")" 2>/dev/null; then
    scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
    # Jobs of other users on this test cluster too (root may cancel them).
    if [[ $(id -u) -eq 0 ]]; then
        squeue -h -o %i 2>/dev/null | xargs -r scancel --quiet 2>/dev/null || true
    fi
fi

stop_pidfile slurmd "$DIR/run/slurmd.pid"
stop_pidfile slurmctld "$DIR/run/slurmctld.pid"
stop_pidfile slurmdbd "$DIR/run/slurmdbd.pid"
stop_pidfile MariaDB "$DIR/run/mysqld.pid"
if [[ -e $DIR/run/munged.ours ]]; then
    stop_pidfile munged /run/munge/munged.pid
    rm -f "$DIR/run/munged.ours"
fi

if ((purge)); then
    for f in slurm.conf slurmdbd.conf gres.conf; do
        if [[ -f $ETC/$f ]] && grep -qF "$MARK" "$ETC/$f"; then
            rm -f "$ETC/$f"
        fi
    done
    case $DIR in
        /|/var|/var/lib|/etc|/usr|"") log "refusing to delete $DIR" ;;
        *) rm -rf "$DIR"; log "removed $DIR" ;;
    esac
fi
log "stopped"
