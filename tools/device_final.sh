#!/usr/bin/env bash
# The whole chain on a multi-GPU device machine, through the `mlem` command:
# generate -> convert -> norm -> transpose -> partition -> simulate -> the float64
# reference -> CUDA runs on 1, 2 and 4 GPUs (both layouts, with and without graph
# capture, each taking its GPUs with --lease), then every GPU test under pytest.
#   usage (repository root, on the device): bash tools/device_final.sh OUTDIR
set -uo pipefail
out=${1:?OUTDIR}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MLEM_LOCK_DIR=/tmp/mlem-locks
mlem() { python3 -m mlemlib "$@"; }
w=$(mktemp -d)
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi -L
set -e
mlem generate --preset small --out "$w/small.csr4" > /dev/null
mlem convert "$w/small.csr4" --out "$w/matrix.h5"
mlem norm "$w/matrix.h5" --out "$w/norm.h5"
mlem transpose "$w/matrix.h5" --method cusparse --out "$w/transpose.h5"
mlem simulate "$w/matrix.h5" --phantom nema --seed 1 --out "$w/g.LMsino" --truth "$w/truth.h5"
common=(--matrix "$w/matrix.h5" --sino "$w/g.LMsino" --norm "$w/norm.h5" --iterations 50 -k 0)
mlem reconstruct "${common[@]}" --transpose "$w/transpose.h5" --reference-mode --out "$w/ref.h5"
set +e
for p in 1 2 4; do
    ((p > ngpu)) && continue
    ((p > 1)) && mlem partition "$w/matrix.h5" --transpose "$w/transpose.h5" --parts $p --out "$w/parts-$p" > /dev/null
    for layout in local thesis; do
        ((p == 1)) && [[ $layout == thesis ]] && continue
        for graph in "" --graph; do
            d="$w/run-$p-$layout${graph}"
            plan=(); ((p > 1)) && plan=(--plan "$w/parts-$p")
            mlem reconstruct "${common[@]}" --transpose "$w/transpose.h5" --backend cuda --fp csr_vector --bp csr_vector \
                --gpus $p --layout $layout $graph "${plan[@]}" --lease --reference "$w/ref.h5" -r 2 --out "$d/image.h5" \
                2> "$d.log" || { echo "FAILED: $d"; tail -5 "$d.log"; }
        done
    done
done
python3 - "$w" <<'PY' | tee "$out/chain.txt"
import glob, json, sys, h5py, numpy as np
w = sys.argv[1]
def img(p):
    with h5py.File(p) as f:
        return np.asarray(f["image"], dtype=np.float64).ravel()
ref = img(f"{w}/ref.h5")
one = img(f"{w}/run-1-local/image.h5")
print(f"{'run':24s} {'relL2 vs float64 ref':>22s} {'relL2 vs 1 GPU':>15s} {'ms/it (median)':>15s} deterministic")
for d in sorted(glob.glob(f"{w}/run-*/")):
    x = img(d + "image.h5")
    t = json.load(open(d + "timings.json"))
    it = t["repetitions"][-1]["steps"]["iteration"]["median"]
    print(f"{d.rstrip('/').split('/')[-1]:24s} {np.linalg.norm(x-ref)/np.linalg.norm(ref):22.3e} "
          f"{np.linalg.norm(x-one)/np.linalg.norm(one):15.3e} {it * 1e3:15.3f} {t.get('deterministic')}")
PY
cp "$w"/run-*.log "$out"/ 2>/dev/null; tar czf "$out/runs.tgz" -C "$w" $(cd "$w" && ls -d run-* ) 2>/dev/null
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_dist.py tests/test_cuda_mlem.py tests/test_cuda_kernels.py \
    tests/test_transpose.py tests/test_bench.py 2>&1 | tee "$out/gpu_tests.log" | tail -15
