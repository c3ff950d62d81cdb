"""int4 settings against fp32 full depth, in one interleaved run: which setting keeps agreement highest per ms.

    flock /tmp/eectl-heavy.lock python benchmarks/int4_sweep.py --threads 2 --out /tmp/int4-sweep

Exports the default model (or MODEL) once in fp32 and once per int4 setting (block size, accuracy level, algorithm,
final LM-head precision, layers kept in fp32) with eectl's own export (ORT's MatMulNBits quantizer), then decodes
the same GSM8K prompts greedily at full depth with every artifact, interleaved (A B C ... A B C ...), and prints:
ms/token (median over repetitions), speed vs fp32, greedy token agreement / exact match / first divergence vs fp32,
the export validation's teacher-forced agreement with PyTorch, and the artifact size ratio. Outside the package:
a measurement, not a feature.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

SETTINGS = {  # name -> Int4Options fields
    "b32-a4": dict(block_size=32, accuracy_level=4),
    "b32-a0": dict(block_size=32, accuracy_level=0),
    "b64-a4": dict(block_size=64, accuracy_level=4),
    "b128-a4": dict(block_size=128, accuracy_level=4),
    "b32-a4-sym": dict(block_size=32, accuracy_level=4, symmetric=True),
    "b32-a4-hqq": dict(block_size=32, accuracy_level=4, algorithm="hqq"),
    "b32-a4-lm8": dict(block_size=32, accuracy_level=4, lm_head="int8"),
    "b32-a4-lm4": dict(block_size=32, accuracy_level=4, lm_head="int4"),
    "b32-a4-keep-ends": dict(block_size=32, accuracy_level=4, keep_layers="ends"),
    "b128-a4-lm4": dict(block_size=128, accuracy_level=4, lm_head="int4"),
}


def size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="/tmp/int4-sweep")
    ap.add_argument("--keep", action="store_true", help="keep the artifacts")
    args = ap.parse_args()

    import torch

    from eectl.contracts.layers import default_exits
    from eectl.data import encode_prompt, load_text_data
    from eectl.evaluate.stats import agreement as _agreement
    from eectl.export.exporter import ExportOptions, export_artifact
    from eectl.export.quantize import Int4Options
    from eectl.models import load_model
    from eectl.runtime.ort import init_ort
    from eectl.runtime.runner import Runner
    from eectl.runtime.sessions import ArtifactRuntime
    from eectl.runtime.state import RunConfig

    torch.set_num_threads(args.threads)
    init_ort(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.model)
    L = loaded.adapter.num_layers
    exits = default_exits(L)  # the default cut, so the numbers are those of `eectl export` artifacts
    arts: dict[str, Path] = {}
    validation: dict[str, float | None] = {}
    t0 = time.time()
    arts["fp32"] = out / "fp32"
    if not (arts["fp32"] / "manifest.json").exists():
        export_artifact(loaded, arts["fp32"], ExportOptions(exits=exits, force=True, validate=False))
    validation["fp32"] = None
    for name in args.settings.split(","):
        fields = dict(SETTINGS[name])
        if fields.get("keep_layers") == "ends":
            fields["keep_layers"] = (0, L - 1)
        opts = Int4Options(min_agreement=0.0, **fields)  # type: ignore[arg-type]
        art = out / name
        m = export_artifact(loaded, art, ExportOptions(exits=exits, weights="int4", int4=opts, force=True))
        arts[name] = art
        validation[name] = m.validation["greedy_agreement"][str(L)]
        print(f"exported {name} ({time.time() - t0:.0f} s)", flush=True)
    tok = loaded.tokenizer
    data = load_text_data("/work/shared/data/gsm8k/train.jsonl")
    prompts = [encode_prompt(tok, p) for p in data.prompts[-args.prompts :]]
    runners = {}
    for name, art in arts.items():
        rt = ArtifactRuntime(art, provider="cpu", threads=args.threads, verify=False)
        stop = tuple(rt.manifest.eos_token_ids)
        runners[name] = Runner(rt, RunConfig(exits=[], thresholds={}, max_new_tokens=args.tokens, stop_ids=stop))
    for r in runners.values():  # warm-up
        r.generate([prompts[0]])
    times: dict[str, list[float]] = {n: [] for n in runners}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.reps):
        for name, r in runners.items():
            lat: list[float] = []
            gens = []
            for p in prompts:
                g = r.generate([p])[0]
                lat.extend(g.latencies_s[1:])
                gens.append(g.token_ids)
            times[name].append(1000 * sum(lat) / len(lat))
            tokens.setdefault(name, gens)
    base = statistics.median(times["fp32"])
    base_size = size(arts["fp32"])
    rows = []
    print(
        f"\n{args.threads} threads, {len(prompts)} GSM8K prompts x {args.tokens} greedy tokens, {args.reps} "
        "interleaved reps\n"
    )
    print(
        "| setting | ms/token (median, min-max) | vs fp32 | agreement vs fp32 | exact | first div. | "
        "validation agreement vs torch | size vs fp32 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in runners:
        ms = statistics.median(times[name])
        agree, exact, first = _agreement(tokens[name], tokens["fp32"])
        v = validation[name]
        row = dict(
            setting=name,
            ms=ms,
            spread=(min(times[name]), max(times[name])),
            speedup=base / ms,
            agreement=agree,
            exact=exact,
            first_divergence=first,
            validation_agreement=v,
            size_ratio=size(arts[name]) / base_size,
        )
        rows.append(row)
        print(
            f"| {name} | {ms:.1f} ({row['spread'][0]:.1f}-{row['spread'][1]:.1f}) | {base / ms:.2f}x | {agree:.1%} | "
            f"{exact:.0%} | {first:.1f} | {'-' if v is None else f'{v:.1%}'} | {row['size_ratio']:.2f} |"
        )
    (out / "sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
    if not args.keep:
        for name, art in arts.items():
            if name != "fp32":
                shutil.rmtree(art, ignore_errors=True)


if __name__ == "__main__":
    main()
