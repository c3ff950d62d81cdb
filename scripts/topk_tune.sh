#!/bin/bash
# #13 item 3: the top-k + tail loss against the exact KL at equal training tokens, per tail sample size, on one state
# cache (the same tokens in the same order for every run: TokenStream is a function of the seed). Run it as a
# measurement (its tokens/s are reported): /work/wt/measure scripts/topk_tune.sh CACHE TOKENS
# RUNS: loss:tail[:shortlist] ... Prints one line per run: loss, tail (+ shortlist), training tokens/s (optimiser steps only) and held-out agreement per exit.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
P=/work/main/.venv/bin/python
CACHE=${1:?cache folder}
TOKENS=${2:-6400}
EVAL=${3:-4000}
RUNS=${4:-"exact:-1 topk:1024 topk:4096 topk:16384 topk:-1"}
uptime
for run in $RUNS; do
  IFS=: read -r loss tail list <<<"$run"
  set -- $loss $tail ${list:-0}
  out=artifacts/tune-$1-$2-$3.safetensors
  $P scripts/heads_table.py train --cache "$CACHE" --design residual-linear --loss $1 --tail $2 --shortlist $3 --tokens $TOKENS \
    --batch 64 --eval-report $EVAL --out $out 2>/dev/null >artifacts/tune.log
  $P - "$out" "$1" "$2+$3" <<'PY'
import json, sys
m = json.load(open(sys.argv[1].replace(".safetensors", ".json")))
t, rep = m["training"], m["report"]["after"]["exits"]
print(f"{sys.argv[2]:5s} tail {sys.argv[3]:>6s}: {t['tokens_per_s']:7.1f} tokens/s ({t['tokens']} tokens, {t['threads']} threads); "
      "held-out agreement " + " / ".join(f"{x['agreement']:.3f}" for x in rep) + "; KL " + " / ".join(f"{x['kl']:.2f}" for x in rep), flush=True)
PY
  uptime
done
