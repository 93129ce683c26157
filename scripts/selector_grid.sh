#!/usr/bin/env bash
# The selector's scores on this machine's CPU grid (issue 42): `medium` and `large` at
# global batch 64, 256 and 1024 on 1 and 2 ranks of one thread, RUNS times, against the
# calibration in the cache (`mpirun -np 2 python -m mgpu topo --threads 1` first). Each
# model's cells and scores go to OUT/run-K-MODEL.json; each run's scores over both models
# print as one line.
#   bash scripts/selector_grid.sh            (OUT=out/selector-grid RUNS=3)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/mpi_env.sh
OUT=${OUT:-out/selector-grid}
RUNS=${RUNS:-3}
mkdir -p "$OUT"
for k in $(seq 1 "$RUNS"); do
  for model in medium large; do
    .venv/bin/python -m mgpu bench --model "$model" --batch-sizes 64,256,1024 --ranks 1,2 --threads 1 \
      --validate-selector --no-progress --json "$OUT/run-$k-$model.json" > "$OUT/run-$k-$model.txt"
  done
  echo -n "run $k: "
  .venv/bin/python - "$OUT/run-$k-medium.json" "$OUT/run-$k-large.json" <<'PY'
import json
import sys

from mgpu.calibrate.bench import score_validation
from mgpu.commands.bench import format_scores

rows, validation = [], []
for path in sys.argv[1:]:
    with open(path) as f:
        result = json.load(f)
    rows += result["rows"]
    validation += result["validation"]
print(format_scores(score_validation(rows, validation)))
PY
done
