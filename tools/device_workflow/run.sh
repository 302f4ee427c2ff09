#!/usr/bin/env bash
# Device demonstration: the real workflow, run as `snakemake --cores 4 --resources gpu=G`,
# starts concurrent GPU jobs (run_mlem) that land on disjoint GPUs thanks to the lock-file
# GPU leases (mlemlib/dist/lease.py, taken by scripts/run_mlem.py).
#
#   usage (repository root on the device, with .whl carried): bash tools/device_workflow/run.sh OUTDIR GPUS
#
# Installs Snakemake from the wheels in .whl/ into /tmp/site (the device image has none;
# see the pip command below), then runs this repository's Snakefile in a scratch working
# directory per scenario, with a fresh MLEM_LOCK_DIR, while nvidia-smi samples which
# process uses which GPU, and checks the job logs with check_leases.py:
#   one-gpu  config one-gpu.yaml: four 1-GPU runs under --resources gpu=min(GPUS,4); that
#            many hold a GPU at once, each its own.
#   two-gpu  config two-gpu.yaml: two 2-GPU runs (layouts local, thesis) under
#            --resources gpu=4; with 4 or more GPUs both at once on disjoint pairs; with 2,
#            Snakemake starts both and the second waits for the first's lease (serialised).
#   madpet2  config madpet2.yaml (only when named): the thesis-scale preset through every
#            stage with all CPUs, then MLEM on 1 and 2 GPUs in both layouts, with and
#            without graphs, under --resources gpu=GPUS; OUTDIR/madpet2-summary.md is the
#            workflow's summary (its "Scaling over GPUs" table). About 7 minutes.
#   time-to-result  config time-to-result.yaml (only when named; issue 40): a user's madpet2
#            configuration from nothing (its own order, CSR, the float64 reference, the SpMV
#            benchmark, MLEM on 1, 2 and 4 GPUs as --resources gpu=GPUS allows) with all CPUs,
#            at most $TIME_TO_RESULT_LIMIT s (default 540); then the disk's sequential read
#            speed (dd of the largest file the workflow wrote). OUTDIR/time-to-result.md starts
#            with job_times.py's tables (total, every job, the MLEM jobs up to their first
#            iteration, the targets, the critical path), then the lease check.
#   matrix3  config matrix3.yaml (only when named; issue 38): the thesis's Matrix 3 from
#            nothing (generated folded and compressed, norm, measurement, both one passes on
#            1, 2 and 4 GPUs as --resources gpu=GPUS allows, the summary) with all CPUs, at
#            most $MATRIX3_LIMIT s (default 540); OUTDIR/matrix3.md as time-to-result's,
#            judged against 150 s in all.
# Default scenarios: one-gpu two-gpu.
# OUTDIR gets gpus.txt (nvidia-smi) and, per scenario, <scenario>.md (the checker's tables
# and verdict) and <scenario>.tgz (logs/, benchmarks/, results/summary/*/, Snakemake's log
# and metadata, the nvidia-smi samples). Exit status 0 when every scenario's workflow and
# check passed (a missed time-to-result target is reported, not failed).
set -uo pipefail

usage="usage: bash tools/device_workflow/run.sh OUTDIR GPUS [SCENARIO ...]"
out=${1:?$usage}
ngpu=${2:?$usage}
shift 2
scenarios=${*:-one-gpu two-gpu}
[[ $ngpu =~ ^[1-9][0-9]*$ ]] || {
    echo "run.sh: error: GPUS must be a positive integer, found '$ngpu'" >&2
    exit 2
}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
scratch=${MLEM_DEMO_SCRATCH:-/tmp/mlem-device-workflow}
mkdir -p "$out"
out=$(cd "$out" && pwd)

# NVLink multicast stays off on these shared machines (docs/multigpu.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

# Snakemake from the wheels of .whl/ where Python has none (the device image).
if ! python3 -c 'import snakemake' 2> /dev/null; then
    if ! compgen -G "$repo/.whl/*.whl" > /dev/null; then
        echo "run.sh: error: python3 has no Snakemake and $repo/.whl holds no wheels (make them with tools/device_workflow/fetch_wheels.sh and carry .whl)" >&2
        exit 2
    fi
    if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$repo"/.whl/*.whl; then
        echo "run.sh: error: installing the wheels of $repo/.whl into /tmp/site failed" >&2
        exit 2
    fi
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The Snakefile imports mlemlib from this checkout (its jobs get it from rules/common.smk).
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
echo "snakemake $(python3 -m snakemake --version) ($(python3 -c 'import snakemake, sys; print(snakemake.__file__, sys.version.split()[0])'))"

smi=$(command -v nvidia-smi || true)
if [[ -n $smi ]]; then
    {
        nvidia-smi -L
        nvidia-smi --query-gpu=index,pci.bus_id,uuid,name --format=csv
    } | tee "$out/gpus.txt"
    seen=$(nvidia-smi -L | grep -c '^GPU ')
    ((seen == ngpu)) || echo "run.sh: warning: GPUS=$ngpu but nvidia-smi lists $seen GPU(s)" >&2
else
    echo "run.sh: warning: no nvidia-smi: the driver's view of the jobs is left out" | tee "$out/gpus.txt" >&2
fi

# dd_pass DD_OPERANDS...: "BYTES SECONDS" that one dd pass read (at most 4 GiB in 16 MiB blocks,
# stopped after 15 s: on SIGINT dd still reports what it read); nothing if dd reported nothing.
dd_pass() {
    timeout -s INT 15 dd of=/dev/null bs=16M count=256 "$@" 2>&1 | awk '/ copied, / { print $1, $(NF - 3) }'
}
# pass_text "BYTES SECONDS": "N GB in S s (R GB/s)", or "failed".
pass_text() {
    awk '$1 > 0 && $2 > 0 { printf "%.2f GB in %.2f s (%.2f GB/s)", $1 / 1e9, $2, $1 / $2 / 1e9; ok = 1 }
        END { if (!ok) printf "failed" }' <<< "$1"
}
bytes_per_s() { awk '$1 > 0 && $2 > 0 { printf "%.0f", $1 / $2 }' <<< "$1"; }

# disk_speed FILE: the sequential read speed of the disk holding FILE into disk_bw (bytes/s, empty
# if not measured) and disk_note (how): dd with O_DIRECT (no page cache) where the file system
# allows it, and buffered after dropping the page cache where that is allowed (else the cache may
# still hold the file, and its speed is the cache's). disk_bw is the direct pass's where it worked.
disk_speed() {
    local file=$1 fs direct buffered cache="the page cache could not be dropped here, so it may hold the file"
    fs=$(df -PT "$file" 2> /dev/null | awk 'NR == 2 { print $2 " on " $1 }')
    direct=$(dd_pass if="$file" iflag=direct)
    if [[ -w /proc/sys/vm/drop_caches ]] && timeout 30 sync && (echo 3 > /proc/sys/vm/drop_caches) 2> /dev/null; then
        cache="after dropping the page cache"
    fi
    buffered=$(dd_pass if="$file")
    disk_note="dd of ${file#"$scratch"/} ($(du -h "$file" | cut -f1), ${fs:-file system unknown}), 16 MiB blocks:"
    disk_note+=" iflag=direct (no page cache) $(pass_text "$direct"); buffered, $cache, $(pass_text "$buffered")"
    disk_bw=$(bytes_per_s "$direct")
    if [[ -z $disk_bw ]]; then
        disk_bw=$(bytes_per_s "$buffered")
        disk_note+="; the speed used is the buffered pass's"
    fi
}

# scenario NAME CONFIG GPU_RESOURCE CHECKER_OPTIONS...: one workflow run and its check
# ($CORES cores, default 4; $LIMIT seconds at most, default 240). With TIMES=1 the scenario's
# md starts with job_times.py's tables and the disk's speed, judged against issue 40's targets.
failed=()
scenario() {
    local name=$1 config=$2 resource=$3 cores=${CORES:-4} limit=${LIMIT:-240}
    shift 3
    local w=$scratch/$name
    rm -rf "$w" && mkdir -p "$w/locks"
    local sampler=
    if [[ -n $smi ]]; then
        # Which process runs on which GPU, as the driver sees it, every ~0.2 s.
        while :; do
            nvidia-smi --query-compute-apps=pid,gpu_bus_id --format=csv,noheader 2> /dev/null
            sleep 0.2
        done > "$w/apps.csv" &
        sampler=$!
    fi
    local cmd=(python3 -m snakemake --snakefile "$repo/Snakefile" --configfile "$here/$config"
        --cores "$cores" --resources "gpu=$resource")
    echo
    echo "== $name: ${cmd[*]} (in $w, MLEM_LOCK_DIR=$w/locks)"
    local t0 t1 took
    t0=$(date +%s.%N)
    (cd "$w" && MLEM_LOCK_DIR=$w/locks timeout "$limit" "${cmd[@]}") > "$w/snakemake.log" 2>&1
    local rc=$?
    t1=$(date +%s.%N)
    took=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
    if [[ -n $sampler ]]; then
        kill "$sampler" 2> /dev/null
        wait "$sampler" 2> /dev/null
    fi
    echo "snakemake exit status $rc after $took s"
    ((rc == 0)) || tail -n 40 "$w/snakemake.log"
    local apps=() times=()
    [[ -n $sampler ]] && apps=(--apps "$w/apps.csv")
    if [[ -n ${TIMES:-} ]]; then
        local big
        big=$(find "$w/results" "$w/resources" -type f -printf '%s %p\n' 2> /dev/null | sort -n | tail -n 1 | cut -d' ' -f2-)
        disk_bw='' disk_note="not measured (no file written)"
        [[ -n $big ]] && disk_speed "$big"
        echo "disk: ${disk_bw:-?} B/s; $disk_note"
        # Issue 40's targets: the whole workflow, the float64 reference, a GPU job's first iteration.
        times=(--started "$t0" --total "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')"
        --disk-note "$disk_note" --target-total "${TARGET_TOTAL:-120}" --target-first-iteration 1.5)
        [[ -n ${TARGET_REFERENCE-20} ]] && times+=(--target-reference "${TARGET_REFERENCE-20}")
        [[ -n $disk_bw ]] && times+=(--disk-bw "$disk_bw")
        compgen -G "$w/.snakemake/log/*.snakemake.log" > /dev/null || times+=(--snakemake-log "$w/snakemake.log")
    fi
    {
        echo "# $name: \`snakemake --cores $cores --resources gpu=$resource --configfile tools/device_workflow/$config\`"
        echo
        echo "$ngpu GPU(s); Snakemake exit status $rc after $took s; checker options: ${*:-none}"
        echo
        if ((${#times[@]})); then
            echo "## Time to result (tools/device_workflow/job_times.py)"
            echo
            python3 "$here/job_times.py" "$w" "${times[@]}"
            echo
            echo "## GPU leases (tools/device_workflow/check_leases.py)"
            echo
        fi
        python3 "$here/check_leases.py" "${apps[@]}" "$@" "$w/logs"
    } > "$out/$name.md"
    local crc=$?
    cat "$out/$name.md"
    local keep=(snakemake.log)
    for p in logs benchmarks results/summary apps.csv .snakemake/log .snakemake/metadata; do [[ -e $w/$p ]] && keep+=("$p"); done
    tar czf "$out/$name.tgz" -C "$w" "${keep[@]}"
    # results/summary/{config name}/ (default where the scenario's config sets none)
    for md in "$w"/results/summary/*/summary.md; do
        [[ -f $md ]] && cp "$md" "$out/$name-summary.md"
    done
    ((rc == 0 && crc == 0)) || failed+=("$name (snakemake $rc, check $crc)")
}

one=$((ngpu < 4 ? ngpu : 4))
# Every scenario's leases count warm_kernels' (one GPU, before any run: the runs take its record as input).
for name in $scenarios; do
    case $name in
    one-gpu) scenario one-gpu one-gpu.yaml "$one" --jobs 5 --min-concurrent "$one" --max-concurrent "$one" ;;
    two-gpu)
        if ((ngpu >= 4)); then
            scenario two-gpu two-gpu.yaml 4 --jobs 3 --min-concurrent 2
        elif ((ngpu >= 2)); then
            scenario two-gpu two-gpu.yaml 4 --jobs 3 --max-concurrent 1 --min-waited 1
        fi
        ;;
    madpet2) CORES=$(nproc) LIMIT=${MADPET2_LIMIT:-480} scenario madpet2 madpet2.yaml "$ngpu" --jobs 7 ;;
    time-to-result)
        # One lease per run on 1, 2 and 4 GPUs that --resources gpu=GPUS allows, bench_spmv's and warm_kernels'.
        leases=2
        for g in 1 2 4; do ((g <= ngpu)) && leases=$((leases + 1)); done
        TIMES=1 CORES=$(nproc) LIMIT=${TIME_TO_RESULT_LIMIT:-540} scenario time-to-result time-to-result.yaml "$ngpu" --jobs "$leases"
        ;;
    matrix3)
        # One lease per run (two kernels) on 1, 2 and 4 GPUs that --resources gpu=GPUS allows, and warm_kernels'.
        leases=1
        for g in 1 2 4; do ((g <= ngpu)) && leases=$((leases + 2)); done
        TIMES=1 TARGET_TOTAL=150 TARGET_REFERENCE='' CORES=$(nproc) LIMIT=${MATRIX3_LIMIT:-540} \
            scenario matrix3 matrix3.yaml "$ngpu" --jobs "$leases"
        ;;
    *)
        echo "run.sh: error: unknown scenario '$name' (one-gpu, two-gpu, madpet2, time-to-result, matrix3)" >&2
        exit 2
        ;;
    esac
done

echo
if ((${#failed[@]})); then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "every scenario passed; files in $out: $(cd "$out" && ls | tr '\n' ' ')"
