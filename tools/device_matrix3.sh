#!/usr/bin/env bash
# The Matrix 3 chain (config/thesis-matrix3.yaml) on a lent 2-GPU node, across device calls of
# at most 10 minutes each (docs/cluster.md, "The matrix3 run").
#
#   bash tools/device_matrix3.sh start OUTDIR [SECONDS]   install Snakemake from .whl/, start the chain in
#                                                         its own process session, then follow it
#   bash tools/device_matrix3.sh wait OUTDIR [SECONDS]    follow a running chain (next call, machine warm)
#   bash tools/device_matrix3.sh collect OUTDIR           only copy what there is into OUTDIR
#   bash tools/device_matrix3.sh profile OUTDIR           after the chain: Nsight Compute on one launch of the
#                                                         one-pass kernels (float atomics and fixed point) on
#                                                         Matrix 3 (OUTDIR/ncu-*.txt)
#
# The chain is one `snakemake --cores $(nproc) --resources gpu=2 --configfile
# config/thesis-matrix3.yaml` (every stage, then the report) in $M3_WORK (default: a folder on the
# file system with the most free space), started with setsid so that it outlives the call that
# started it: the next call, made while the machine is still warm, follows it on. Snakemake's
# benchmark files give each job's seconds and peak memory; a sampler records free disk, the
# results' size and the GPUs' memory every 5 s (monitor.tsv), so each stage's disk use is on
# record. A stopped chain goes on where it stopped when started again (Snakemake skips finished
# jobs; MLEM resumes from its checkpoint).
#
# M3_CONFIG names another config file (a small one tries the script out on any machine).
#
# "wait" prints the chain's new log lines and returns after SECONDS (default 540) or when the chain
# has ended; then OUTDIR gets m3.tgz (logs/, benchmarks/, results/summary/, the report,
# Snakemake's log, monitor.tsv, stages.tsv) and status.txt. Exit status: 0 finished, 3 still
# running, 1 failed.
set -uo pipefail

usage="usage: bash tools/device_matrix3.sh start|wait|collect OUTDIR [SECONDS]"
cmd=${1:?$usage}
out=${2:?$usage}
limit=${3:-540}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
state=/tmp/mlem-matrix3 # where the chain says where it works and how it ended
mkdir -p "$out" "$state"

export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
[[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}

workdir() {
    if [[ -n ${M3_WORK:-} ]]; then
        echo "$M3_WORK"
        return
    fi
    # The writable file system with the most free space.
    local best="" most=0 d free
    for d in /data /scratch /mnt /workspace /root /home /tmp "$repo/.."; do
        [[ -d $d && -w $d ]] || continue
        free=$(df -P -B1 "$d" 2> /dev/null | awk 'NR == 2 {print $4}')
        [[ -n $free ]] && ((free > most)) && {
            most=$free
            best=$d
        }
    done
    echo "${best:-/tmp}/mlem-matrix3"
}

install_snakemake() {
    python3 -c 'import snakemake' 2> /dev/null && return 0
    compgen -G "$repo/.whl/*.whl" > /dev/null || {
        echo "device_matrix3: error: python3 has no Snakemake and $repo/.whl holds no wheels (tools/device_workflow/fetch_wheels.sh; carry .whl)" >&2
        return 2
    }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$repo"/.whl/*.whl || {
        echo "device_matrix3: error: installing $repo/.whl into /tmp/site failed" >&2
        return 2
    }
    export PYTHONPATH=/tmp/site:$PYTHONPATH
}

# chain WORK: the whole workflow, then the report; writes $state/rc when it ends.
chain() {
    local w=$1
    mkdir -p "$w"
    cd "$w" || exit 2
    local sm=(python3 -m snakemake --snakefile "$repo/Snakefile" --configfile "${M3_CONFIG:-$repo/config/thesis-matrix3.yaml}"
        --cores "$(nproc)" --resources gpu=2 --rerun-incomplete)
    (
        while :; do
            printf '%s\t%s\t%s\t%s\n' "$(date +%s)" "$(df -P -B1 . | awk 'NR == 2 {print $4}')" \
                "$(du -sb results 2> /dev/null | cut -f1)" \
                "$(nvidia-smi --query-gpu=memory.used,power.draw --format=csv,noheader,nounits 2> /dev/null | tr '\n' ' ')"
            sleep 5
        done
    ) >> monitor.tsv &
    local sampler=$!
    echo "chain: ${sm[*]} (in $w), start $(date -u +%FT%TZ)"
    "${sm[@]}"
    local rc=$?
    echo "chain: snakemake exit status $rc at $(date -u +%FT%TZ)"
    if ((rc == 0)); then
        "${sm[@]}" --report results/report-matrix3.html
        rc=$?
        echo "chain: report exit status $rc"
    fi
    kill "$sampler" 2> /dev/null
    echo "$rc" > "$state/rc"
}

collect() {
    local w
    w=$(cat "$state/work" 2> /dev/null) || {
        echo "device_matrix3: no chain was started on this machine" | tee "$out/status.txt"
        return 1
    }
    # One row per finished job: its benchmark (seconds, peak memory, I/O) beside its output's size.
    python3 - "$w" > "$w/stages.tsv" << 'EOF'
import csv, pathlib, sys
w = pathlib.Path(sys.argv[1])
print("job\ts\tmax_rss_MB\tio_in_MB\tio_out_MB")
for tsv in sorted(w.glob("benchmarks/**/*.tsv")):
    rows = list(csv.DictReader(open(tsv), delimiter="\t"))
    for r in rows:
        print(f"{tsv.relative_to(w / 'benchmarks')}\t{r.get('s')}\t{r.get('max_rss')}\t{r.get('io_in')}\t{r.get('io_out')}")
EOF
    {
        echo "work: $w"
        if [[ -f $state/rc ]]; then echo "chain ended: exit status $(cat "$state/rc")"; else echo "chain running"; fi
        df -h "$w" | tail -1
        du -sh "$w"/results/* 2> /dev/null
        cat "$w/stages.tsv"
    } > "$out/status.txt"
    local keep=() p
    for p in logs benchmarks results/summary results/report-matrix3.html chain.log monitor.tsv stages.tsv .snakemake/log; do
        [[ -e $w/$p ]] && keep+=("$p")
    done
    tar czf "$out/m3.tgz" -C "$w" "${keep[@]}"
    cat "$out/status.txt"
}

# follow SECONDS: print new chain log lines until it ends or SECONDS pass.
follow() {
    local w t0=$SECONDS seen=0 n
    w=$(cat "$state/work")
    while ((SECONDS - t0 < $1)); do
        n=$(wc -l < "$w/chain.log")
        ((n > seen)) && sed -n "$((seen + 1)),${n}p" "$w/chain.log" | grep -v '^\s*$' | cut -c1-300
        seen=$n
        [[ -f $state/rc ]] && break
        sleep 5
    done
}

case $cmd in
start)
    install_snakemake || exit 2
    w=$(workdir)
    mkdir -p "$w"
    echo "$w" > "$state/work"
    rm -f "$state/rc"
    nvidia-smi -L
    df -h "$w" | tail -1
    echo "cores $(nproc), memory $(free -g | awk '/Mem:/ {print $2}') GB"
    # Its own process session: the chain outlives this call (the machine stays warm between calls).
    export -f chain
    export repo state M3_CONFIG
    setsid bash -c "chain '$w'" >> "$w/chain.log" 2>&1 < /dev/null &
    sleep 2
    follow "$limit"
    ;;
wait)
    [[ -f $state/work ]] || {
        echo "device_matrix3: no chain was started on this machine (a fresh machine: run start)" >&2
        exit 2
    }
    follow "$limit"
    ;;
collect) ;;
profile)
    w=$(cat "$state/work") || exit 2
    cd "$w" || exit 2
    for bp in onepass onepass_fixed; do
        mkdir -p "/tmp/ncu-$bp"
        # The third launch: after the kernels' first runs (compilation, tuning). ncu keeps its own clocks off.
        timeout 280 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
            --section Occupancy --section LaunchStats -k regex:onepass --launch-skip 2 --launch-count 1 \
            python3 -m mlemlib reconstruct -m results/matrix3/matrix.h5 -s results/matrix3/data/nema-seed1.LMsino \
            --norm results/matrix3/norm.h5 -n 3 -b cuda --bp "$bp" -k 0 -o "/tmp/ncu-$bp/image.h5" \
            > "$out/ncu-$bp.txt" 2>&1
        echo "ncu $bp: exit status $? ($(grep -c 'Duration' "$out/ncu-$bp.txt") duration lines)"
        grep -E 'onepass|Duration|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per' "$out/ncu-$bp.txt" | head -12
    done
    cd - > /dev/null || exit 2
    ;;
*)
    echo "$usage" >&2
    exit 2
    ;;
esac
collect
if [[ -f $state/rc ]]; then
    [[ $(cat "$state/rc") == 0 ]] && exit 0
    exit 1
fi
exit 3
