"""The weight options run and bench share (runtime/tiers.py): mapped weights, a memory budget, placement."""

from __future__ import annotations

from typing import Annotated

import typer

from eectl.runtime.tiers import WeightOptions

MmapOpt = Annotated[
    bool,
    typer.Option(
        "--mmap-weights",
        help="Map the segments' weights from their files (prepacking off) instead of copying them into memory.",
        rich_help_panel="Weights",
        metavar="",
    ),
]
BudgetOpt = Annotated[
    str | None,
    typer.Option(
        "--memory-budget",
        help="Keep at most SIZE of segment weights resident (200M, 1.5G, 50%); the deeper segments are read from "
        "their files by each token that reaches them (implies --mmap-weights).",
        rich_help_panel="Weights",
    ),
]
PlaceOpt = Annotated[
    str | None,
    typer.Option(
        "--place",
        help="Segment ranges on providers, e.g. 0-3:cuda,4-5:cpu (the rest on --provider).",
        rich_help_panel="Weights",
    ),
]


def weight_options(mmap: bool, budget: str | None, place: str | None) -> WeightOptions:
    """The options, their form checked before any artifact loads."""
    opts = WeightOptions(mmap=mmap, budget=budget, place=place)
    opts.check()
    return opts
