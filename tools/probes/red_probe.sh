#!/bin/bash
cd "$(dirname "$0")"
rm -rf red && cp -r after red
python3 - <<'PY'
p = "red/mlemlib/kernels/compressed.cu"
s = open(p).read()
old = """            const u64 old = atomicAdd(acc + j, u);
            if (old + u < old) atomicOr(flag, 2);"""
assert old in s
s = s.replace(old, "            atomicAdd(acc + j, u);")
open(p, "w").write(s)
PY
python3 -m pip --version > /dev/null
(cd after && PYTHONPATH=$PWD python3 -m mlemlib generate -p matrix3 --fold --voxel-order hilbert -f compressed -o /tmp/m3.h5 > /tmp/gen.log 2>&1); echo generated
for t in after red after red; do (cd $t && PYTHONPATH=$PWD python3 ../red_probe.py /tmp/m3.h5 $t); done
