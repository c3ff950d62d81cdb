#!/bin/bash
# #13 item 4: calibrated mean executed layers against training tokens, on one state cache (scripts/heads_table.py):
#   scripts/heads_scale.sh CACHE DESIGN TAIL TOKENS...      e.g. scripts/heads_scale.sh ~/.cache/eectl/states/x residual-linear 4096 6400 25600
# Each size trains from the first TOKENS of the cache's seeded token order (one epoch when TOKENS = the cache's
# training split), then calibrate's sequential fit (topk-prob, K = 64, target 0.99) on half of the held-out
# sequences, replayed on the other half, without and with --confidence 0.95, counting the head's cost.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
P=/work/main/.venv/bin/python
CACHE=${1:?cache}; DESIGN=${2:?design}; TAIL=${3:?tail}; shift 3
B=64; [ "$DESIGN" = block ] && B=128
for n in "$@"; do
  out=artifacts/scale-$DESIGN-$n.safetensors
  $P scripts/heads_table.py train --cache "$CACHE" --design $DESIGN --loss topk --tail $TAIL --tokens $n --batch $B \
    --eval-report 6000 --out $out 2>/dev/null | grep -v '^ \|^{\|^}' | sed "s/^/$DESIGN $n: /"
  $P scripts/heads_table.py calib --cache "$CACHE" --holdout 0.5 --heads $out 2>/dev/null | sed "s/^/$DESIGN $n: /"
done
