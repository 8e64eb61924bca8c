#!/usr/bin/env bash
# Soak: `zerofx train` at stage 3 with block-buffered output through a slow pipe, the shape that
# used to crash a rank on gloo (docs/failure-modes.md, "A rank that crashes";
# NOTE [gloo's completion race] in passes/zero/gather_into_buffers.py). Runs up to
# RUNS runs of STEPS steps; stops at the first crash and keeps its log and the core dump.
#
#   bash benchmarks/soak_piped_train.sh [RUNS=8] [STEPS=3000] [OUT_DIR=soak-out]
#
# Each run takes 2-15 minutes on 2 cores. A crash leaves OUT_DIR/run-K.log (with every thread's
# Python stack, from faulthandler) and OUT_DIR/core; read it with
#   gdb -batch -ex "thread apply all bt" "$(command -v python3)" OUT_DIR/core
set -uo pipefail
runs="${1:-8}"; steps="${2:-3000}"; out="$(realpath -m "${3:-soak-out}")"
mkdir -p "$out" && cd "$out" || exit 2
ulimit -c unlimited
for k in $(seq 1 "$runs"); do
  # The reader takes 30 ms a line, so the pipe fills and rank 0 blocks in write() now and then.
  env -u PYTHONUNBUFFERED zerofx train --stage 3 --steps "$steps" 2>&1 \
    | python3 -c 'import sys, time
for line in sys.stdin:
    time.sleep(0.03); sys.stdout.write(line); sys.stdout.flush()' > "run-$k.log"
  if grep -q "exited with code\|Fatal Python error" "run-$k.log"; then
    echo "run $k: crashed; see $out/run-$k.log and $out/core"; exit 1
  fi
  echo "run $k: $(grep -c '^step ' "run-$k.log") steps, clean"
done
echo "no crash in $runs runs of $steps steps"
