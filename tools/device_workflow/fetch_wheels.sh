#!/usr/bin/env bash
# Fetch the wheels of tools/device_workflow/wheels.txt for CPython 3.12 on x86-64 Linux
# (the lent GPU machines) into .whl/ at the repository root, which run.sh installs from.
# wheels.txt is derived from the lock, requirements/lock.txt, by wheels_from_lock.py
# (`make lock` runs both).
#
#   bash tools/device_workflow/fetch_wheels.sh [DIR]     (default: .whl)
#
# connection_pool is published as a source archive only: it is built into a
# pure-Python wheel here. Add /.whl/ to .git/info/exclude so the wheels are not committed.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
dest=${1:-$repo/.whl}
mkdir -p "$dest"
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
    plat+=(--platform "$p")
done
mapfile -t pins < <(grep -Ev '^\s*(#|$)' "$here/wheels.txt")
binary=()
for pin in "${pins[@]}"; do
    [[ $pin == connection[-_]pool==* ]] || binary+=("$pin")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d "$dest" "${binary[@]}"
for pin in "${pins[@]}"; do
    [[ $pin == connection[-_]pool==* ]] && python3 -m pip wheel -q --no-deps -w "$dest" "$pin"
done
n=$(find "$dest" -maxdepth 1 -type f -name '*.whl' | wc -l)
echo "fetch_wheels: $n wheels in $dest ($(du -sh "$dest" | cut -f1)); expected ${#pins[@]}"
[[ $n -eq ${#pins[@]} ]]
