"""`eectl train-heads`: options, the call into heads/stage.py (per-token heads, heads from a state cache, or only
probes), the before/after report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from eectl.cli.app import BudgetNameOpt, JsonOpt, ModelArg, RecipeOpt, ThreadsOpt, command, set_threads
from eectl.contracts.layers import needed_layers
from eectl.contracts.recipe import load_recipe
from eectl.output import Output

DataOpt = Annotated[
    str | None, typer.Option(help="Text file, .jsonl, or built-in name (humaneval).", rich_help_panel="Data")
]
FieldOpt = Annotated[
    str | None, typer.Option(help="The .jsonl field to read (detected by default).", rich_help_panel="Data")
]
ExitsOpt = Annotated[
    str | None,
    typer.Option(help="Exit after these layers, comma-separated, e.g. 8,12,16.", rich_help_panel="Heads"),
]
StepsOpt = Annotated[
    int | None, typer.Option(help="Optimiser steps (default: the recipe's, 500).", rich_help_panel="Training")
]
DesignOpt = Annotated[
    str | None,
    typer.Option(help="residual-linear, low-rank, mlp, or block (block: from a --cache).", rich_help_panel="Heads"),
]
RankOpt = Annotated[
    int | None,
    typer.Option(help="Rank of low-rank heads (64) or width of mlp heads (H/2).", rich_help_panel="Heads"),
]
LrOpt = Annotated[
    float | None,
    typer.Option(help="Peak learning rate (AdamW; warm-up, cosine decay).", rich_help_panel="Training"),
]
BatchTokensOpt = Annotated[
    int | None,
    typer.Option(
        help="Tokens per step (per process; default: the recipe's, else 32, or 256 from a --cache).",
        rich_help_panel="Training",
    ),
]
CeWeightOpt = Annotated[
    float, typer.Option(help="Weight of next-token cross-entropy added to the KL.", rich_help_panel="Training")
]
EvalTokensOpt = Annotated[
    int | None,
    typer.Option(
        help="Held-out tokens (the data's last records) for the report (default: 4096).", rich_help_panel="Data"
    ),
]
SeedOpt = Annotated[int, typer.Option(help="Seed of head initialisation and data order.", rich_help_panel="Training")]
SaveEveryOpt = Annotated[
    int, typer.Option(help="Write the checkpoint (.ckpt.safetensors) every N steps.", rich_help_panel="Training")
]
ResumeOpt = Annotated[
    Path | None, typer.Option(help="Continue from this checkpoint (.ckpt.safetensors).", rich_help_panel="Training")
]
DeviceOpt = Annotated[
    str,
    typer.Option(
        help="Torch device: auto (a CUDA GPU when torch sees one, else the CPU), cpu or cuda; on a GPU the "
        "per-token route trains in mixed precision.",
        rich_help_panel="Training",
    ),
]
OutPathOpt = Annotated[
    Path | None,
    typer.Option(
        "--out", help="heads .safetensors (default: artifacts/<model>-heads.safetensors).", rich_help_panel="Output"
    ),
]
CacheOpt = Annotated[
    Path | None,
    typer.Option(
        help="State cache folder: the base runs once into it, heads train from it.", rich_help_panel="State cache"
    ),
]
TokensOpt = Annotated[
    int | None,
    typer.Option(help="With --cache: training tokens (default: the recipe's, 16384).", rich_help_panel="State cache"),
]
GenShareOpt = Annotated[
    float | None,
    typer.Option(help="With --cache: share of generated tokens (default: 0.25).", rich_help_panel="State cache"),
]
LossOpt = Annotated[
    str | None,
    typer.Option(help="With --cache: topk (teacher top-k + tail) or exact.", rich_help_panel="State cache"),
]
BlockInitOpt = Annotated[str, typer.Option(help="block design: last, next or identity.", rich_help_panel="Heads")]
ProbeOnlyOpt = Annotated[
    bool,
    typer.Option(
        "--probe-only",
        help="Only fit the learned signal's probes onto --heads (from --cache), write --out.",
        rich_help_panel="Probes",
        metavar="",
    ),
]
HeadsOpt = Annotated[
    Path | None,
    typer.Option(help="With --probe-only: the heads file to fit probes onto.", rich_help_panel="Probes"),
]
ProbeTokensOpt = Annotated[
    int | None,
    typer.Option(help="Training tokens the probes are fitted on (default: 131072).", rich_help_panel="Probes"),
]
ProbeHiddenOpt = Annotated[
    int | None,
    typer.Option(
        help="Hidden units of the MLP probe, kept per exit where it beats a logistic one (default: 32; 0: never).",
        rich_help_panel="Probes",
    ),
]


@command("train-heads")
def train_heads(
    model: ModelArg = None,
    data: DataOpt = None,
    field: FieldOpt = None,
    exits: ExitsOpt = None,
    steps: StepsOpt = None,
    design: DesignOpt = None,
    rank: RankOpt = None,
    lr: LrOpt = None,
    batch_tokens: BatchTokensOpt = None,
    ce_weight: CeWeightOpt = 0.0,
    eval_tokens: EvalTokensOpt = None,
    seed: SeedOpt = 0,
    save_every: SaveEveryOpt = 100,
    resume: ResumeOpt = None,
    device: DeviceOpt = "auto",
    out_path: OutPathOpt = None,
    cache: CacheOpt = None,
    tokens: TokensOpt = None,
    gen_share: GenShareOpt = None,
    loss: LossOpt = None,
    block_init: BlockInitOpt = "last",
    probe_only: ProbeOnlyOpt = False,
    heads: HeadsOpt = None,
    probe_tokens: ProbeTokensOpt = None,
    probe_hidden: ProbeHiddenOpt = None,
    recipe: RecipeOpt = None,
    budget: BudgetNameOpt = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Light exit heads trained against the frozen model's own final layer (KL), reported before and after."""
    from eectl.heads.stage import HeadsRequest
    from eectl.heads.stage import train_heads as train

    out = Output(json_out)
    r = load_recipe(recipe, budget)
    req = HeadsRequest(
        model=model,
        data=data,
        field=field,
        exits=needed_layers(exits, "train-heads"),
        steps=steps,
        design=design,
        rank=rank,
        lr=lr,
        batch_tokens=batch_tokens,
        ce_weight=ce_weight,
        eval_tokens=eval_tokens,
        seed=seed,
        save_every=save_every,
        resume=resume,
        device=device,
        out=out_path,
        cache=cache,
        tokens=tokens,
        gen_share=gen_share,
        loss=loss,
        block_init=block_init,
        probe_only=probe_only,
        heads=heads,
        probe_tokens=probe_tokens,
        probe_hidden=probe_hidden,
        recipe_file=recipe,
    )
    req.threads = set_threads(threads, r)
    print_heads(out, train(r, req, out))


def print_heads(out: Output, result: object) -> None:
    """What `eectl train-heads` prints: the before/after table of trained heads, or the probes fitted."""
    from eectl.heads.stage import ProbesResult
    from eectl.heads.train import TrainResult

    if isinstance(result, ProbesResult):
        fit = result.fit
        out.json({"heads": str(result.out), "probe": fit.to_dict()})
        out.log(
            f"probes for exits {', '.join(fit.agreement)} fitted on {fit.tokens} tokens in {fit.train_s:.1f} s "
            f"(label rate {' '.join(f'{k}:{v:.3f}' for k, v in fit.agreement.items())}; kept "
            f"{' '.join(f'{k}:{v}' for k, v in fit.chosen.items())}); wrote {result.out}"
        )
        return
    assert isinstance(result, TrainResult)
    if not result.main:  # another process of a distributed run: rank 0 reports
        return
    out.json(result.to_dict())
    _print_heads(out, result)


def _print_heads(out: Output, result: object) -> None:
    from eectl.heads.report import iter_report
    from eectl.heads.train import TrainResult

    assert isinstance(result, TrainResult) and result.meta is not None
    meta = result.meta
    rows = [
        (
            b["layer"],
            f"{b['agreement']:.3f} -> {a['agreement']:.3f}",
            f"{b['kl']:.3f} -> {a['kl']:.3f}",
            f"{b['coverage_full']:.1%} -> {a['coverage_full']:.1%}",
            f"{b['coverage_topk']:.1%} -> {a['coverage_topk']:.1%}",
        )
        for b, a in iter_report(meta)
    ]
    rep, t = meta.report, meta.training
    out.table(
        f"{meta.base_model['name']}: {meta.design} heads, {rep['tokens']} held-out tokens, before -> after",
        [
            "exit",
            "top-1 agree",
            "KL(final||exit)",
            f"coverage @{rep['target_precision']} (full)",
            f"coverage @{rep['target_precision']} (top-{rep['top_k']})",
        ],
        rows,
    )
    L = meta.dimensions.num_layers
    for name in ("before", "after"):
        s = rep[name]
        out.line(
            f"{name}: oracle exit mean layers {s['oracle_mean_layers']:.2f} of {L}; exits at the thresholds above "
            f"(full-vocab, in-sample): mean layers {s['sequential_mean_layers']:.2f}, "
            f"agreement {s['sequential_agreement']:.4f}"
        )
    cost = meta.head_cost
    out.line(
        f"{t['steps']} steps x {t['batch_tokens']} tokens ({meta.data['epochs']} epochs of "
        f"{meta.data['train_tokens']} tokens), {t['precision']} on {t['device']}; {cost.params} params per "
        f"head; {t['wall_s']:.1f}s ({t['train_s']:.1f}s training) on {t['threads']} threads"
    )
    out.line(f"written: {result.out} and {result.sidecar}; checkpoint {result.checkpoint}")
