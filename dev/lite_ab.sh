#!/bin/bash
# The lite section (DeepSeek-V2-Lite shape, batch 1 and 32) at several commits, one after another on one GPU, so a
# change is measured against its base on the same machine; AB_SECTIONS picks other suite sections (the mixed
# workload: AB_SECTIONS=ceilings,mixed, as its roofline needs the ceilings).
#   [AB_SECTIONS=lite] bash dev/lite_ab.sh OUT_DIR REF [REF ...]
# A REF is a commit (needs git history: run it in a clone) or a folder holding a tree (mlaserve, benchmarks,
# pyproject.toml; `git archive COMMIT mlaserve benchmarks pyproject.toml | tar -x -C DIR` makes one where the GPU
# host has no history), its commit in DIR/COMMIT. "." is the working tree.
# Writes OUT_DIR/SECTIONS-NAME.json per REF, commas as + (python -m benchmarks.gpu_suite --sections SECTIONS there).
set -u
sections=${AB_SECTIONS:-lite}
tag=${sections//,/+}
out=$(realpath "$1")
shift
mkdir -p "$out"
for ref in "$@"; do
  if [ -d "$ref" ]; then
    tree=$(realpath "$ref")
    commit=$(cat "$tree/COMMIT" 2>/dev/null || echo "${MLASERVE_COMMIT:-unknown}")
    name=$(basename "$tree")
    [ "$ref" = "." ] && name=head
  else
    tree=$(mktemp -d)
    git archive "$ref" mlaserve benchmarks pyproject.toml | tar -x -C "$tree"
    commit=$ref
    name=$ref
  fi
  (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" MLASERVE_COMMIT="$commit" \
    python -m benchmarks.gpu_suite --sections "$sections" --out "$out/$tag-$name.json" \
    | grep -E "lite batch|\"run\"" | sed "s/^/$name: /")
  [ -d "$ref" ] || rm -rf "$tree"
done
