#!/bin/bash
# The lite section (DeepSeek-V2-Lite shape, batch 1 and 32) at several commits, one after another on one GPU, so a
# change is measured against its base on the same machine. Needs git history: run it in a clone, on the GPU host.
#   bash benchmarks/diagnose/lite_ab.sh OUT_DIR COMMIT [COMMIT ...]
# Writes OUT_DIR/lite-COMMIT.json per commit (python benchmarks/gpu_suite.py --sections lite in a copy of that tree).
set -u
out=$(realpath "$1")
shift
mkdir -p "$out"
for commit in "$@"; do
  tree=$(mktemp -d)
  git archive "$commit" mlaserve benchmarks pyproject.toml | tar -x -C "$tree"
  (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" MLASERVE_COMMIT="$commit" \
    python benchmarks/gpu_suite.py --sections lite --out "$out/lite-$commit.json" | grep "lite batch")
  rm -rf "$tree"
done
