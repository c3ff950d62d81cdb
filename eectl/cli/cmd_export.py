"""`eectl export`: options, the call into export/stage.py, the validation table."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from eectl.cli.app import JsonOpt, ModelArg, RecipeOpt, ThreadsOpt, command, set_threads
from eectl.contracts.layers import parse_layers
from eectl.contracts.recipe import load_recipe
from eectl.errors import UsageError
from eectl.export.quantize import DEFAULT_MIN_AGREEMENT, Int4Options
from eectl.output import Output

if TYPE_CHECKING:
    from eectl.export.stage import ExportResult


ExitsOpt = Annotated[
    str | None, typer.Option(help="Exit after these layers, e.g. 8,12,16,20,24.", rich_help_panel="Artifact")
]
OutOpt = Annotated[
    Path | None, typer.Option(help="Artifact folder (default: artifacts/<model-name>).", rich_help_panel="Artifact")
]
CalibrationOpt = Annotated[
    Path | None, typer.Option(help="calibration.json from eectl calibrate.", rich_help_panel="Artifact")
]
HeadsOpt = Annotated[
    Path | None, typer.Option(help="heads.safetensors from eectl train-heads.", rich_help_panel="Artifact")
]
DtypeOpt = Annotated[str, typer.Option(help="fp32, or fp16 for GPU deployment.", rich_help_panel="Artifact")]
TopKOpt = Annotated[
    int | None, typer.Option("--top-k", help="Default local vocabulary size.", rich_help_panel="Artifact")
]
CandidatesOpt = Annotated[
    str | None,
    typer.Option(
        help="Candidate source: shortlist-int8, shortlist, int8, first-exit-topk (default: the calibration's).",
        rich_help_panel="Artifact",
    ),
]
ForceOpt = Annotated[
    bool, typer.Option("--force", help="Replace an existing artifact.", rich_help_panel="Artifact", metavar="")
]
WeightsOpt = Annotated[
    str | None,
    typer.Option(
        help="fp32, or int4: weight-only MatMulNBits segment graphs (default: the recipe's weights, fp32).",
        rich_help_panel="int4",
    ),
]
RiverOpt = Annotated[
    bool,
    typer.Option(
        "--river", help="Add int4 copies of the segments after the first exit.", rich_help_panel="int4", metavar=""
    ),
]
# The int4 options below default to None: not given, the recipe's int4 section sets them (under `weights: int4`),
# else Int4Options' defaults; given, they win over the recipe.
Int4BlockSizeOpt = Annotated[
    int | None,
    typer.Option(help="int4: input channels per scale (default: the recipe's, else 32).", rich_help_panel="int4"),
]
Int4SymmetricOpt = Annotated[
    bool | None,
    typer.Option(
        "--int4-symmetric", help="int4: no zero points (default: the recipe's).", rich_help_panel="int4", metavar=""
    ),
]
Int4AccuracyLevelOpt = Annotated[
    int | None,
    typer.Option(
        help="int4: MatMulNBits compute, 0 fp32 .. 4 int8 (default: the recipe's, else 4).", rich_help_panel="int4"
    ),
]
Int4AlgorithmOpt = Annotated[
    str | None,
    typer.Option(help="int4: rtn (ORT's default) or hqq (default: the recipe's, else rtn).", rich_help_panel="int4"),
]
Int4KeepLayersOpt = Annotated[
    str | None,
    typer.Option(help="int4: decoder layers left in fp32, e.g. 0,29 (default: the recipe's).", rich_help_panel="int4"),
]
Int4FromOpt = Annotated[
    str | None,
    typer.Option(
        "--int4-from",
        help="int4: where the weights come from: gguf (the GGUF's own quantized blocks, exactly), ort (ONNX Runtime "
        "re-quantizes the fp32 weights) or auto (gguf for a GGUF of quantized blocks; default: the recipe's, "
        "else auto).",
        rich_help_panel="int4",
    ),
]
LmHeadOpt = Annotated[
    str | None,
    typer.Option(
        help="int4: the final LM head in fp32, int8 or int4 (default: the recipe's, else fp32); from a GGUF whose "
        "table is of that width (Q8_0 for int8), the file's own blocks.",
        rich_help_panel="int4",
    ),
]
ExactWideOpt = Annotated[
    bool | None,
    typer.Option(
        "--exact-wide/--no-exact-wide",
        help="Run one-row calls with one zero position after theirs (every MatMul on two rows, attention on two "
        "positions) so wide passes (drafts, deferred positions) compute each position exactly as a one-position step "
        "on AVX2 and AVX-512 CPUs alike: lossless drafts on int4 at --int4-accuracy-level 2-4 (on there by default).",
        rich_help_panel="int4",
        metavar="",
    ),
]
MinAgreementOpt = Annotated[
    float,
    typer.Option(help="int4: fail below this greedy agreement with PyTorch at the final exit.", rich_help_panel="int4"),
]


@command()
def export(
    model: ModelArg = None,
    exits: ExitsOpt = None,
    out: OutOpt = None,
    calibration: CalibrationOpt = None,
    heads: HeadsOpt = None,
    dtype: DtypeOpt = "fp32",
    top_k: TopKOpt = None,
    candidates: CandidatesOpt = None,
    force: ForceOpt = False,
    weights: WeightsOpt = None,
    river: RiverOpt = False,
    int4_block_size: Int4BlockSizeOpt = None,
    int4_symmetric: Int4SymmetricOpt = None,
    int4_accuracy_level: Int4AccuracyLevelOpt = None,
    int4_algorithm: Int4AlgorithmOpt = None,
    int4_keep_layers: Int4KeepLayersOpt = None,
    int4_from: Int4FromOpt = None,
    lm_head: LmHeadOpt = None,
    min_agreement: MinAgreementOpt = DEFAULT_MIN_AGREEMENT,
    exact_wide: ExactWideOpt = None,
    recipe: RecipeOpt = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Segmented ONNX graphs cut at the exit points, exit heads and a manifest, validated against PyTorch."""
    from eectl.export.exporter import ExportOptions
    from eectl.export.stage import ExportRequest
    from eectl.export.stage import export as run_export

    keep = parse_layers(int4_keep_layers, "--int4-keep-layers")
    given: dict[str, Any] = {  # the int4 options given (None: not given)
        "block_size": int4_block_size,
        "symmetric": int4_symmetric,
        "accuracy_level": int4_accuracy_level,
        "algorithm": int4_algorithm,
        "lm_head": lm_head,
        "keep_layers": None if keep is None else tuple(sorted(set(keep))),
        "source": int4_from,
    }
    out_ = Output(json_out)
    r = load_recipe(recipe)
    int4 = Int4Options(min_agreement=min_agreement)
    if weights is None and r.int4_twin() is not None:  # the recipe's int4 weights: its quantization settings
        spec = r.int4
        int4 = replace(
            int4, **({field: getattr(spec, field) for field in given} | {"keep_layers": (*spec.keep_layers,)})
        )
        exact_wide = spec.exact_wide if exact_wide is None else exact_wide
    int4 = replace(int4, **{field: v for field, v in given.items() if v is not None})  # an option wins over both
    weights = weights or r.weights
    if weights == "fp32" and not river:
        _no_int4_options(int4)
    options = ExportOptions(
        exits=[], dtype=dtype, force=force, weights=weights, int4=int4, river=river, candidates=candidates
    )
    options.exact_wide = exact_wide
    options.cost_seconds = r.export.cost_seconds
    req = ExportRequest(model, parse_layers(exits), out, calibration, heads, top_k, options)
    req.threads = set_threads(threads, r)
    print_export(out_, run_export(r, req, out_))


INT4_FLAGS = {
    "block_size": "--int4-block-size",
    "symmetric": "--int4-symmetric",
    "accuracy_level": "--int4-accuracy-level",
    "algorithm": "--int4-algorithm",
    "keep_layers": "--int4-keep-layers",
    "lm_head": "--lm-head",
    "source": "--int4-from",
    "min_agreement": "--min-agreement",
}


def _no_int4_options(int4: Int4Options) -> None:
    """An fp32 export without --river makes no int4 graph: an int4 option set away from its default would be dropped,
    silently (their values are still checked first, as for an int4 export)."""
    int4.check(None)
    default = Int4Options()
    given = [flag for field, flag in INT4_FLAGS.items() if getattr(int4, field) != getattr(default, field)]
    if given:
        raise UsageError(
            f"{given[0]} shapes int4 graphs, but this export makes none (fp32 weights)",
            hint="add --weights int4 or --river, or drop it",
        )


def print_export(out: Output, done: ExportResult) -> None:
    """What `eectl export` prints: the validation table, the int4 agreement, the artifact and its plan."""
    manifest, folder, summary = done.manifest, done.folder, done.summary
    out.json(summary)
    v = manifest.validation
    out.table(
        f"{folder}: validation ({v.get('dtype')}, prefill {v.get('prompt_tokens')} + {v.get('decode_steps')} steps)",
        ["exit after layer", "max abs logit diff", "local logits diff", "greedy mismatches"],
        [
            (k, f"{d:.2e}", f"{v['max_abs_local_logit_diff'][k]:.2e}", v["greedy_token_mismatches"][k])
            for k, d in v.get("max_abs_logit_diff", {}).items()
        ],
    )
    if w := v.get("int4_weights"):
        out.line(
            f"int4 weights: the GGUF's own blocks ({', '.join(f'{n} {t}' for t, n in w['gguf_types'].items())}), "
            f"largest difference from its dequantized weights {w['max_abs_weight_diff']:.3g}"
            + (f"; kept fp32: {w['not_held']}" if w["not_held"] else "")
        )
    for part in (v, v.get("river") or {}):
        if "greedy_agreement" in part:
            agree = part["greedy_agreement"][str(manifest.num_layers)]
            out.line(
                f"{part['graphs']} graphs: greedy agreement with PyTorch {agree:.1%} (floor {part['min_agreement']})"
            )
    out.line(
        f"artifact: {folder} ({summary['size_mb']} MB, {len(manifest.segments)} segments, "
        f"exported and validated in {v.get('export_seconds')} s, peak RSS {v.get('peak_rss_mb')} MB)"
    )
    if manifest.plan is not None:
        out.line(manifest.plan.summary())
