#!/usr/bin/env bash
# What the container checksum costs the stages that write and verify a matrix, on a lent machine's
# CPUs and disk (no GPU used): the generator (folded matrix3, lossless compressed), the checksum
# verification of its output, and `mlem convert` of madpet2's .csr4 into CSR and lossless
# compressed containers. With OLD=<another tree of the repository> every step runs under that tree
# too, old before new, on the same machine (the numbers of section 71 of docs/benchmarks.md).
#
#   PYTHONPATH=. [OLD=.scratch/old] [STEPS="generate verify convert"] bash tools/device_writer_speed.sh OUTDIR
#
# STEPS picks the steps (default all three). OUTDIR gets steps.tsv and steps.tgz (each step's
# output: the command's own JSON summary, and its log).
set -uo pipefail
out=${1:?usage: bash tools/device_writer_speed.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
tmp=${WRITER_TMP:-/tmp/writer-speed}
rm -rf "$tmp" && mkdir -p "$tmp"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
trees=("new=$repo")
[[ -n ${OLD:-} ]] && trees=("old=$(cd "$OLD" && pwd)" "${trees[@]}")
printf 'tree\tstep\twall_s\tbytes\tGB_per_s\n' > "$out/steps.tsv"

step() { # tree name path-of-bytes command...
    local tree=$1 name=$2 bytes_of=$3
    shift 3
    local t0 wall bytes
    t0=$(date +%s%N)
    "$@" > "$out/$tree-$name.json" 2> "$out/$tree-$name.log"
    local rc=$?
    wall=$((($(date +%s%N) - t0) / 1000000))
    bytes=$(stat -c %s "$bytes_of" 2> /dev/null || echo 0)
    python3 -c "import sys; t, n, ms, b = sys.argv[1:]; print(f'{t}\t{n}\t{int(ms) / 1e3:.2f}\t{b}\t{int(b) / int(ms) / 1e6:.3f}')" \
        "$tree" "$name" "$wall" "$bytes" >> "$out/steps.tsv"
    echo "$tree $name: rc $rc, $wall ms"
    tail -n 2 "$out/$tree-$name.log"
}

verify() { # path: recompute the checksum, print it and the seconds as JSON
    python3 -c "
import json, sys, time
from mlemlib.formats import MatrixH5
t = time.perf_counter()
with MatrixH5(sys.argv[1]) as r:
    got = r.compute_checksum(); ok = got == r.checksum; method = r.attrs.get('checksum_method', '')[:40]
print(json.dumps({'ok': ok, 'checksum': got, 'method': method, 'seconds': time.perf_counter() - t}))
" "$1"
}

steps=${STEPS:-generate verify convert}
has() { [[ " $steps " == *" $1 "* ]]; }
nproc
if has convert; then
    PYTHONPATH=$repo python3 -m mlemlib generate --preset madpet2 -o "$tmp/m2.csr4" > "$out/madpet2-csr4.json" 2> "$out/madpet2-csr4.log"
fi
for t in "${trees[@]}"; do
    tree=${t%%=*}
    export PYTHONPATH=${t#*=}
    cd "$PYTHONPATH" || exit 1 # python puts the working directory first on sys.path
    python3 -m mlemlib generate --preset small -o "$tmp/warm.h5" -f compressed --fold > /dev/null 2>&1 # Numba's cache
    if has generate; then
        step "$tree" generate-m3 "$tmp/m3.h5" python3 -m mlemlib generate --preset matrix3 --fold -f compressed -o "$tmp/m3.h5"
        has verify && step "$tree" verify-m3 "$tmp/m3.h5" verify "$tmp/m3.h5"
        rm -f "$tmp/m3.h5"
    fi
    if has convert; then
        step "$tree" convert-csr "$tmp/m2.h5" python3 -m mlemlib convert "$tmp/m2.csr4" -o "$tmp/m2.h5"
        has verify && step "$tree" verify-csr "$tmp/m2.h5" verify "$tmp/m2.h5"
        step "$tree" convert-compressed "$tmp/m2c.h5" python3 -m mlemlib convert "$tmp/m2.csr4" -o "$tmp/m2c.h5" -f compressed
        rm -f "$tmp/m2.h5" "$tmp/m2c.h5"
    fi
done
cd "$out" || exit 1
tar czf steps.tgz --exclude steps.tgz --exclude steps.tsv ./*.json ./*.log && rm -f ./*.json ./*.log
cat "$out/steps.tsv"
rm -rf "$tmp"
