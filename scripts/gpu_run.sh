#!/bin/bash
# The last device call of a GPU run (docs/gpu-check.md): join the parts sent by the earlier calls, run
# scripts/gpu_check on the CUDA EP with the real default model, then `eectl pipeline --budget standard` with the torch
# stages on the GPU, within LIMIT seconds in all (default 560; the device tool's call limit is 600).
#   carry: [".gpu-pack/call-NN" (the last call's parts), ".gpu-pack/data" (gsm8k.jsonl: GSM8K train, copied there)]
#   env:   LIMIT=seconds, SKIP_PIPELINE=1 to run the check alone
# Everything it prints is timestamped (seconds since start) into $OUT/run.log and $OUT/pipeline.log; gpu_check
# mirrors its summary and log into $OUT; the pipeline's reports come back as $OUT/results.tgz.
R=/tmp/eectl-gpu; LIMIT=${LIMIT:-560}; T0=$(date +%s)
G=$(ls $R/files/*.gguf $R/parts/*.gguf.part000 2>/dev/null | head -1); G=$R/files/$(basename "${G%.part000}")
stamp() { while IFS= read -r l; do printf '%s %s\n' "$(( $(date +%s) - T0 ))" "$l"; done; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; nproc; python3 --version
  last=$(ls -d .gpu-pack/call-* | tail -1); mkdir -p $R/parts && cp "$last"/* $R/parts/
  [ -d $R/files ] || python3 scripts/gpu_pack.py unpack --parts $R/parts --to $R/files || exit 1
} 2>&1 | stamp | tee -a "$OUT/run.log"
PYTHONUNBUFFERED=1 timeout $(( LIMIT - ($(date +%s) - T0) )) python3 scripts/gpu_check.py --provider cuda \
  --wheels $R/files --gguf "$G" --out $R/out --mirror "$OUT" --threads 16 2>&1 | stamp | tee -a "$OUT/run.log"
left=$(( LIMIT - ($(date +%s) - T0) ))
echo "pipeline: $left s left" | tee -a "$OUT/run.log"
[ -z "$SKIP_PIPELINE" ] && [ $left -gt 30 ] || exit 0
export EECTL_CACHE=$R/out/cache PYTHONUNBUFFERED=1
timeout $left $R/out/venv/bin/python -m eectl.cli pipeline --model "$G" --data .gpu-pack/data/gsm8k.jsonl \
  --budget standard --threads 16 2>&1 | stamp > "$OUT/pipeline.log"
tar czf "$OUT/results.tgz" artifacts/*.md artifacts/*.json artifacts/*/manifest.json 2>/dev/null
echo "done at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/run.log"
