"""The export stage as one library call: a recipe and a request in, a validated artifact written and its manifest out.

What `eectl export` and the pipeline both run (export/exporter.py does the work). A request's None fields take the
recipe's values; the caller has set up the thread pools (cli.app.set_threads). What this module does not do: print.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eectl.contracts.manifest import Manifest
from eectl.contracts.recipe import Recipe, pick
from eectl.errors import UsageError
from eectl.export.exporter import ExportOptions
from eectl.files import existing_file
from eectl.output import Output
from eectl.output_checks import is_inside


@dataclass
class ExportRequest:
    model: str | None = None  # None: the recipe's
    exits: list[int] | None = None  # None: the calibration's, else the heads', else the recipe's, else the default
    out: Path | None = None  # the artifact folder; None: artifacts/<model name>
    calibration: Path | None = None
    heads: Path | None = None
    top_k: int | None = None  # None: the recipe's
    options: ExportOptions = dataclasses.field(default_factory=lambda: ExportOptions(exits=[]))  # exits, top_k: above
    threads: int | None = None  # the thread count set up by the caller (reported)


@dataclass
class ExportResult:
    manifest: Manifest
    folder: Path
    summary: dict[str, Any]  # export/exporter.py describe(): sizes, segments, exits


def export(recipe: Recipe, req: ExportRequest, out: Output) -> ExportResult:
    """Everything that needs no model checked first, then the model (and heads) loaded and the artifact exported."""
    from eectl.contracts.calibration import read_calibration
    from eectl.export.exporter import check_options, choose_exits, export_artifact
    from eectl.models import load_model, resolve_source

    r = recipe
    cal = read_calibration(req.calibration) if req.calibration is not None else None
    if req.heads is not None:
        existing_file(req.heads, "heads", UsageError, hint="train them with eectl train-heads")
    # Everything that needs no model is checked before the seconds-long load.
    folder = req.out or Path("artifacts") / resolve_source(pick(req.model, r.model)).name
    options = dataclasses.replace(req.options, exits=req.exits or [], top_k=pick(req.top_k, r.top_k))
    check_options(options, folder)
    for option, given in (("--heads", req.heads), ("--calibration", req.calibration)):
        if given is not None and is_inside(Path(given), folder):  # --force would replace the folder, inputs too
            raise UsageError(f"{option} {given} is inside --out {folder}, which export writes; move it out first")
    loaded = load_model(pick(req.model, r.model), log=out)
    head_modules, heads_meta = None, None
    if req.heads is not None:
        from eectl.exits.designs import load_heads

        head_set = load_heads(req.heads, loaded)  # checks they were trained on this checkpoint
        head_modules, heads_meta = head_set.heads, head_set.meta
    options.exits = choose_exits(loaded.adapter.num_layers, req.exits, cal, head_modules, r.exits)
    out.log(
        f"exporting {loaded.source.name} with exits {options.exits} to {folder} ({options.dtype}, "
        f"{req.threads} threads)"
    )
    manifest = export_artifact(loaded, folder, options, head_modules, heads_meta, cal, log=out)
    return ExportResult(manifest, folder, describe(manifest, folder))


def describe(manifest: Manifest, folder: Path) -> dict[str, Any]:
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    L = manifest.num_layers
    return {
        "artifact": str(folder),
        "model": manifest.model.get("name"),
        "dtype": manifest.dtype,
        "segments": [list(s.layers) for s in manifest.segments],
        "exits": manifest.exit_layers,
        "size_mb": round(size / 1e6, 1),
        "quantization": None if manifest.quantization is None else manifest.quantization.model_dump(),
        "validation": manifest.validation,
        "candidate_source": {k: v for k, v in manifest.candidate_source.items() if k != "ids"},
        "costs": None if manifest.costs is None else manifest.costs.model_dump(),
        # block exit heads: per token, in decoder layers (static shape ratio; measured on this machine where timed)
        "block_heads": {
            str(e.layer): {
                "cost_layers": e.block.cost_layers,
                "measured_layers": None if manifest.costs is None else manifest.costs.block_layers(L).get(str(e.layer)),
            }
            for e in manifest.exits
            if e.block is not None
        },
        "plan": None if manifest.plan is None else manifest.plan.model_dump(),
    }
