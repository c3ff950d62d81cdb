#!/bin/bash
# #13 measurements in one hold of the heavy lock (run it as: flock /tmp/eectl-heavy.lock scripts/heads_table_all.sh):
# state cache, the four designs trained and calibrated, exact vs top-k KL, then the full test suite
set -x
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
P=/work/main/.venv/bin/python
T=scripts/heads_table.py
date
timeout 1200 $P $T build --threads 2 --text 6000 --gen 1500 --eval-text 6000 --eval-gen 2000 2>&1 | tr '\r' '\n' | tail -3
date
date
timeout 200 $P $T calib --holdout 0.3 2>/dev/null
for d in residual-linear block mlp low-rank; do
  B=64; [ $d = block ] && B=128
  timeout 600 $P $T train --design $d --tokens 7680 --batch $B --out artifacts/h-$d.safetensors 2>/dev/null
  timeout 200 $P $T calib --holdout 0.3 --heads artifacts/h-$d.safetensors 2>/dev/null
  date
done
timeout 400 $P $T train --design residual-linear --loss exact --tail -1 --tokens 4096 --batch 64 --out artifacts/h-rl-exact-4k.safetensors 2>/dev/null
timeout 200 $P $T train --design residual-linear --loss topk --tokens 4096 --batch 64 --out artifacts/h-rl-topk-4k.safetensors 2>/dev/null
date
git log --oneline | head -1
timeout 900 $P -m pytest -q -x 2>&1 | tail -5
date
