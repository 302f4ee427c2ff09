#!/usr/bin/env bash
# Start a single-node SLURM cluster on this machine, for testing the workflow's
# SLURM profile (profiles/slurm) against a real slurmctld/slurmd/slurmdbd.
#
# What it does (idempotent: a second call with everything up just re-checks):
#   1. installs Debian's packages if missing: slurmctld slurmd slurm-client
#      slurmdbd munge mariadb-server (needs root and apt; Debian 12 ships 22.05)
#   2. writes /etc/slurm/{slurm.conf,slurmdbd.conf,gres.conf} (marked as ours; a
#      foreign slurm.conf is never overwritten)
#   3. starts munged (unless one runs), a private MariaDB on 127.0.0.1:$DB_PORT
#      holding the accounting database, slurmdbd, slurmctld and slurmd
#   4. registers cluster "mlemlocal", account "mlem" and the users in accounting
#   5. waits until the node is idle
#
# Accounting (slurmdbd + MariaDB) is needed because the executor plugin polls job
# states with `sacct`, and `sacct` without slurmdbd answers nothing in SLURM 22.05.
# The node advertises $FAKE_GPUS count-only GPUs (GRES "gpu:fake", no device
# files) so that GPU rules' `--gpus` requests can be scheduled and checked in
# accounting on a machine without GPUs; jobs there see no CUDA device.
#
# Settings (environment):
#   MLEM_SLURM_DIR       state, spool, logs, database   (default /var/lib/mlem-slurm)
#   MLEM_SLURM_MEM_MB    node RealMemory in MB          (default: detected minus 512)
#   MLEM_SLURM_FAKE_GPUS count of fake GPUs on the node (default 2; 0 = none)
#   MLEM_SLURM_DB_PORT   private MariaDB port           (default 3307)
#   MLEM_SLURM_USERS     extra users to register        (default: $SUDO_USER)
#   MLEM_SLURM_TIMEOUT   seconds to wait for each daemon (default 60)
#
# Logs: $MLEM_SLURM_DIR/log/*.log.  Stop with tools/slurm/stop.sh.
set -euo pipefail

DIR=${MLEM_SLURM_DIR:-/var/lib/mlem-slurm}
FAKE_GPUS=${MLEM_SLURM_FAKE_GPUS:-2}
DB_PORT=${MLEM_SLURM_DB_PORT:-3307}
TIMEOUT=${MLEM_SLURM_TIMEOUT:-60}
CLUSTER=mlemlocal
ACCOUNT=mlem
PARTITION=debug
ETC=/etc/slurm
MARK="# Managed by mlem tools/slurm/start.sh (single-node test cluster)."

log() { printf 'slurm-start: %s\n' "$*" >&2; }
die() { printf 'slurm-start: error: %s\n' "$*" >&2; exit 1; }

# wait_for DESCRIPTION COMMAND...: retry COMMAND every second until it succeeds.
wait_for() {
    local what=$1; shift
    local i
    for ((i = 0; i < TIMEOUT; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 1
    done
    die "timed out after ${TIMEOUT}s waiting for $what (logs: $DIR/log/)"
}

# pid_alive FILE: the process named in pid file FILE runs.
pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

[[ $(id -u) -eq 0 ]] || die "must run as root (it installs packages and starts daemons)"

# --- 1. packages ------------------------------------------------------------
need=()
for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client sacct:slurm-client \
            slurmdbd:slurmdbd munged:munge mariadbd:mariadb-server; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
if ((${#need[@]})); then
    mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
    log "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# --- 2. configuration ---------------------------------------------------------
if [[ -e $ETC/slurm.conf ]] && ! grep -qF "$MARK" "$ETC/slurm.conf"; then
    die "$ETC/slurm.conf exists and was not written by this script; refusing to replace it"
fi
mkdir -p "$DIR"/{state,spool,log,run} "$ETC"
chmod 755 "$DIR"

node=$(hostname -s)
hw=$(slurmd -C | head -n 1)   # NodeName=... CPUs=... Boards=... RealMemory=...
mem_detected=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
mem=${MLEM_SLURM_MEM_MB:-$((mem_detected - 512))}
topology=$(sed -e 's/^NodeName=[^ ]* //' -e 's/ *RealMemory=[0-9]*//' <<<"$hw")
# Fake GPUs: SLURM drops file-less GPUs, so each gets a character device
# (a copy of /dev/null) under $DIR/dev.
gres_line=""
gres_types=""
if ((FAKE_GPUS > 0)); then
    mkdir -p "$DIR/dev"
    for ((i = 0; i < FAKE_GPUS; i++)); do
        if [[ ! -c $DIR/dev/fakegpu$i ]]; then
            rm -f "$DIR/dev/fakegpu$i"
            if ! mknod -m 666 "$DIR/dev/fakegpu$i" c 1 3 2>/dev/null; then
                log "warning: cannot create device nodes here (mknod); the node gets no fake GPUs"
                FAKE_GPUS=0
                break
            fi
        fi
    done
fi
if ((FAKE_GPUS > 0)); then
    gres_line=" Gres=gpu:fake:$FAKE_GPUS"
    gres_types="GresTypes=gpu"
fi

cat >"$ETC/slurm.conf.new" <<EOF
$MARK
# Remove it with tools/slurm/stop.sh --purge.
ClusterName=$CLUSTER
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
# No cgroups in a container: track processes through /proc, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
SchedulerType=sched/backfill
ReturnToService=2
# Keep finished jobs visible to squeue/scontrol for 10 minutes as well.
MinJobAge=600
KillWait=5
InactiveLimit=0
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=5
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819
AccountingStorageTRES=gres/gpu
AccountingStoreFlags=job_comment
JobCompType=jobcomp/none
$gres_types
NodeName=$node NodeAddr=127.0.0.1 $topology RealMemory=$mem$gres_line State=UNKNOWN
PartitionName=$PARTITION Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
mv "$ETC/slurm.conf.new" "$ETC/slurm.conf"

if ((FAKE_GPUS > 0)); then
    printf '%s\nNodeName=%s Name=gpu Type=fake File=%s/dev/fakegpu[0-%d]\n' \
        "$MARK" "$node" "$DIR" $((FAKE_GPUS - 1)) >"$ETC/gres.conf"
else
    rm -f "$ETC/gres.conf"
fi

# The database password is made once and kept in slurmdbd.conf (mode 600).
dbpass=""
if [[ -f $ETC/slurmdbd.conf ]]; then
    dbpass=$(sed -n 's/^StoragePass=//p' "$ETC/slurmdbd.conf")
fi
[[ -n $dbpass ]] || dbpass=$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')
umask 077
cat >"$ETC/slurmdbd.conf" <<EOF
$MARK
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$dbpass
StorageLoc=slurm_acct_db
EOF
umask 022

# --- 3. daemons ---------------------------------------------------------------
# munge: reuse a running munged, otherwise start one as user munge.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    [[ -s /etc/munge/munge.key ]] || mungekey --create --force
    chown munge:munge /etc/munge/munge.key
    chmod 600 /etc/munge/munge.key
    install -d -o munge -g munge -m 755 /run/munge
    install -d -o munge -g munge -m 700 /var/lib/munge /var/log/munge
    log "starting munged"
    runuser -u munge -- munged
    touch "$DIR/run/munged.ours"
    wait_for munged sh -c 'munge -n | unmunge'
fi

# MariaDB: a private instance (own data directory, socket and port).
sock=$DIR/run/mysqld.sock
if ! pid_alive "$DIR/run/mysqld.pid"; then
    if [[ ! -d $DIR/mysql/mysql ]]; then
        log "initialising the accounting database in $DIR/mysql"
        install -d -o mysql -g mysql -m 750 "$DIR/mysql"
        mariadb-install-db --no-defaults --user=mysql --datadir="$DIR/mysql" \
            --auth-root-authentication-method=socket --skip-test-db >"$DIR/log/mysql-install.log" 2>&1 \
            || die "mariadb-install-db failed (see $DIR/log/mysql-install.log)"
    fi
    chown mysql:mysql "$DIR/run"
    touch "$DIR/log/mysqld.log"
    chown mysql:mysql "$DIR/log/mysqld.log"
    log "starting MariaDB on 127.0.0.1:$DB_PORT"
    setsid mariadbd --no-defaults --user=mysql --datadir="$DIR/mysql" --socket="$sock" \
        --port="$DB_PORT" --bind-address=127.0.0.1 --pid-file="$DIR/run/mysqld.pid" \
        --log-error="$DIR/log/mysqld.log" --innodb-buffer-pool-size=64M \
        --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &
    wait_for MariaDB mariadb-admin --no-defaults --socket="$sock" ping
fi
mariadb --no-defaults --socket="$sock" -u root <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$dbpass';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$dbpass';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
EOF

if ! pid_alive "$DIR/run/slurmdbd.pid"; then
    log "starting slurmdbd"
    slurmdbd
fi
wait_for slurmdbd sacctmgr -n list cluster

# --- 4. accounting entities (before slurmctld registers) -------------------------
sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER" \
    || sacctmgr -i add cluster "$CLUSTER" >/dev/null
sacctmgr -n -P list account format=account | grep -qx "$ACCOUNT" \
    || sacctmgr -i add account "$ACCOUNT" Cluster="$CLUSTER" \
        Description="mlem workflow tests" Organization=mlem >/dev/null
for user in root ${SUDO_USER:-} ${MLEM_SLURM_USERS:-}; do
    sacctmgr -n -P list assoc user="$user" account="$ACCOUNT" cluster="$CLUSTER" format=user \
        | grep -qx "$user" \
        || sacctmgr -i add user "$user" Account="$ACCOUNT" Cluster="$CLUSTER" >/dev/null
done

if ! pid_alive "$DIR/run/slurmctld.pid"; then
    log "starting slurmctld"
    slurmctld
fi
wait_for slurmctld scontrol ping
if ! pid_alive "$DIR/run/slurmd.pid"; then
    log "starting slurmd on node $node"
    slurmd -N "$node"
fi

# --- 5. ready? -----------------------------------------------------------------
# A drain or down state saved from an earlier, misconfigured start is cleared
# once: this node is ours and its configuration was just rewritten.
node_idle() {
    local state
    state=$(sinfo -h -N -n "$node" -o %T)
    case $state in
        idle | mixed | allocated | completing) return 0 ;;
        drain* | down* | inval*)
            scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true
            return 1 ;;
        *) return 1 ;;
    esac
}
wait_for "node $node to become idle" node_idle
log "ready: cluster $CLUSTER, partition $PARTITION, account $ACCOUNT, node $node" \
    "($(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hw") CPUs, ${mem} MB, $FAKE_GPUS fake GPUs)"
