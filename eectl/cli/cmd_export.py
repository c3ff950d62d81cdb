"""`eectl export`: options, the call into export/exporter.py, the validation table."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from eectl.cli.app import JsonOpt, ModelArg, RecipeOpt, ThreadsOpt, command, set_threads
from eectl.contracts.layers import parse_layers
from eectl.contracts.recipe import load_recipe, pick
from eectl.errors import UsageError
from eectl.export.quantize import DEFAULT_MIN_AGREEMENT
from eectl.files import existing_file, is_inside
from eectl.output import Output


@command()
def export(
    model: ModelArg = None,
    exits: Annotated[
        str | None, typer.Option(help="Exit after these layers, e.g. 8,12,16,20,24.", rich_help_panel="Artifact")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Artifact folder (default: artifacts/<model-name>).", rich_help_panel="Artifact")
    ] = None,
    calibration: Annotated[
        Path | None, typer.Option(help="calibration.json from eectl calibrate.", rich_help_panel="Artifact")
    ] = None,
    heads: Annotated[
        Path | None, typer.Option(help="heads.safetensors from eectl train-heads.", rich_help_panel="Artifact")
    ] = None,
    dtype: Annotated[str, typer.Option(help="fp32, or fp16 for GPU deployment.", rich_help_panel="Artifact")] = "fp32",
    top_k: Annotated[
        int | None, typer.Option("--top-k", help="Default local vocabulary size.", rich_help_panel="Artifact")
    ] = None,
    candidates: Annotated[
        str | None,
        typer.Option(
            help="Candidate source: shortlist-int8, shortlist, int8, first-exit-topk (default: the calibration's).",
            rich_help_panel="Artifact",
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing artifact.", rich_help_panel="Artifact", metavar="")
    ] = False,
    weights: Annotated[
        str, typer.Option(help="fp32, or int4: weight-only MatMulNBits segment graphs.", rich_help_panel="int4")
    ] = "fp32",
    river: Annotated[
        bool,
        typer.Option(
            "--river", help="Add int4 copies of the segments after the first exit.", rich_help_panel="int4", metavar=""
        ),
    ] = False,
    int4_block_size: Annotated[int, typer.Option(help="int4: input channels per scale.", rich_help_panel="int4")] = 32,
    int4_symmetric: Annotated[
        bool, typer.Option("--int4-symmetric", help="int4: no zero points.", rich_help_panel="int4", metavar="")
    ] = False,
    int4_accuracy_level: Annotated[
        int, typer.Option(help="int4: MatMulNBits compute, 0 fp32 .. 4 int8.", rich_help_panel="int4")
    ] = 4,
    int4_algorithm: Annotated[
        str, typer.Option(help="int4: rtn (ORT's default) or hqq.", rich_help_panel="int4")
    ] = "rtn",
    int4_keep_layers: Annotated[
        str | None, typer.Option(help="int4: decoder layers left in fp32, e.g. 0,29.", rich_help_panel="int4")
    ] = None,
    lm_head: Annotated[
        str, typer.Option(help="int4: the final LM head in fp32, int8 or int4.", rich_help_panel="int4")
    ] = "fp32",
    min_agreement: Annotated[
        float,
        typer.Option(
            help="int4: fail below this greedy agreement with PyTorch at the final exit.", rich_help_panel="int4"
        ),
    ] = DEFAULT_MIN_AGREEMENT,
    recipe: RecipeOpt = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Segmented ONNX graphs cut at the exit points, exit heads and a manifest, validated against PyTorch."""
    from eectl.contracts.calibration import read_calibration
    from eectl.export.exporter import ExportOptions, check_options, choose_exits, describe, export_artifact
    from eectl.export.quantize import Int4Options
    from eectl.models import load_model, resolve_source

    int4 = Int4Options(
        block_size=int4_block_size,
        symmetric=int4_symmetric,
        accuracy_level=int4_accuracy_level,
        algorithm=int4_algorithm,
        lm_head=lm_head,
        keep_layers=tuple(sorted(set(parse_layers(int4_keep_layers, "--int4-keep-layers") or []))),
        min_agreement=min_agreement,
    )

    out_ = Output(json_out)
    r = load_recipe(recipe)
    requested = parse_layers(exits)
    cal = read_calibration(calibration) if calibration is not None else None
    if heads is not None:
        existing_file(heads, "heads", UsageError, hint="train them with eectl train-heads")
    # Everything that needs no model is checked before the seconds-long load.
    folder = out or Path("artifacts") / resolve_source(pick(model, r.model)).name
    options = ExportOptions(
        exits=requested or [],
        dtype=dtype,
        top_k=pick(top_k, r.top_k),
        force=force,
        weights=weights,
        int4=int4,
        river=river,
        candidates=candidates,
    )
    check_options(options, folder)
    for option, given in (("--heads", heads), ("--calibration", calibration)):
        if given is not None and is_inside(Path(given), folder):  # --force would replace the folder, inputs too
            raise UsageError(f"{option} {given} is inside --out {folder}, which export writes; move it out first")
    n_threads = set_threads(threads, r)
    loaded = load_model(pick(model, r.model), log=out_)
    head_modules, heads_meta = None, None
    if heads is not None:
        from eectl.exits.designs import load_heads

        head_set = load_heads(heads, loaded)  # checks they were trained on this checkpoint
        head_modules, heads_meta = head_set.heads, head_set.meta
    exit_layers = choose_exits(loaded.adapter.num_layers, requested, cal, head_modules, r.exits)
    options.exits = exit_layers
    out_.log(f"exporting {loaded.source.name} with exits {exit_layers} to {folder} ({dtype}, {n_threads} threads)")
    manifest = export_artifact(loaded, folder, options, head_modules, heads_meta, cal, log=out_)
    summary = describe(manifest, folder)
    out_.json(summary)
    v = manifest.validation
    out_.table(
        f"{folder}: validation ({v.get('dtype')}, prefill {v.get('prompt_tokens')} + {v.get('decode_steps')} steps)",
        ["exit after layer", "max abs logit diff", "local logits diff", "greedy mismatches"],
        [
            (k, f"{d:.2e}", f"{v['max_abs_local_logit_diff'][k]:.2e}", v["greedy_token_mismatches"][k])
            for k, d in v.get("max_abs_logit_diff", {}).items()
        ],
    )
    for part in (v, v.get("river") or {}):
        if "greedy_agreement" in part:
            agree = part["greedy_agreement"][str(manifest.num_layers)]
            out_.line(
                f"{part['graphs']} graphs: greedy agreement with PyTorch {agree:.1%} (floor {part['min_agreement']})"
            )
    out_.line(
        f"artifact: {folder} ({summary['size_mb']} MB, {len(manifest.segments)} segments, "
        f"exported and validated in {v.get('export_seconds')} s, peak RSS {v.get('peak_rss_mb')} MB)"
    )
    if manifest.plan is not None:
        out_.line(manifest.plan.summary())
