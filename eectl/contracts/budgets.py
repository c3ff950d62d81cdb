"""Training budgets: one name (`--budget quick|standard|thorough`, or `budget:` in a recipe) sets every size of the
pipeline at once: profile tokens, the state cache (teacher-forced text and the model's own greedy continuations),
head training, the learned signal's probes, calibration tokens and the bench.

Every budget takes the same route, the one the studies found to pay: a state cache of the frozen model's states,
heads trained from it with the top-k loss, MLP probes (the `learned` signal), gated calibration and the cost
model's plan. Budgets differ only in sizes, and a larger one extends the smaller one's state cache (its chunks and
continuations are a prefix of the larger one's) instead of starting over. The held-out split is the same in every
budget for that reason: it fixes which records are training records.

What this module does not do: apply a budget to a recipe (contracts/recipe.py `apply_budget`), run anything, or
know a model (sizes are in tokens; what they take on a machine is
measured and reported by the pipeline).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from eectl.errors import UsageError

GEN_LEN = 64  # tokens per greedy continuation in the state cache (heads/state_cache.py CacheSpec.gen_len)
CALIBRATE_GEN_SHARE = 0.25  # share of calibrate's tokens that are greedy continuations (CalibrateOptions.gen_share)
HELD_TOKENS = 1024  # held-out tokens of the state cache (the heads' report): the same in every budget


@dataclass(frozen=True)
class Budget:
    name: str
    profile_tokens: int
    cache_tokens: int  # the state cache's training tokens (teacher-forced + generated)
    gen_share: float  # share of them that are the model's own greedy continuations of the data's prompts
    batch_tokens: int  # tokens per optimiser step (one epoch over the cache)
    probe_tokens: int  # the learned signal's probes
    calibrate_tokens: int
    bench_prompts: int
    bench_tokens: int  # new tokens per bench prompt
    bench_reps: int
    cost_seconds: float  # export's re-timing of the graph costs while the plan is undecided (after 3 batches)
    about: str  # one line: what it is for

    @property
    def gen_tokens(self) -> int:
        return round(self.cache_tokens * self.gen_share)

    @property
    def text_tokens(self) -> int:
        return self.cache_tokens - self.gen_tokens

    def prompts_needed(self) -> int:
        return prompts_needed(self.cache_tokens, self.gen_share, HELD_TOKENS)

    def sizes(self) -> dict[str, Any]:
        """The recipe fields this budget sets, as {section: {field: value}}."""
        return {
            "data": {"tokens": self.calibrate_tokens},
            "profile": {"tokens": self.profile_tokens},
            "heads": {
                "tokens": self.cache_tokens,
                "gen_share": self.gen_share,
                "batch_tokens": self.batch_tokens,
                "probe_tokens": self.probe_tokens,
                "eval_tokens": HELD_TOKENS,
                "loss": "topk",
            },
            "bench": {"prompts": self.bench_prompts, "max_new_tokens": self.bench_tokens, "reps": self.bench_reps},
            "export": {"cost_seconds": self.cost_seconds},
        }


def prompts_needed(tokens: int, gen_share: float, held_tokens: int) -> int:
    """Prompts a state cache of `tokens` training and `held_tokens` held-out tokens needs, `gen_share` of each the
    model's greedy continuations: one continuation of at most GEN_LEN tokens per training prompt, plus the held-out
    records (heads/state_cache_build.py `_split_data` holds out 4x the held-out continuations' need)."""
    gen, held_gen = round(tokens * gen_share), round(held_tokens * gen_share)
    return math.ceil(gen / GEN_LEN) + math.ceil(4 * held_gen / GEN_LEN)


GEN_BATCH = 64  # continuations generated together in the state cache (heads/state_cache.py CacheSpec.gen_batch)


def _steps(tokens: int) -> int:
    """Decode steps that generate `tokens` greedy continuation tokens, GEN_LEN per prompt, GEN_BATCH prompts a batch."""
    return math.ceil(math.ceil(tokens / GEN_LEN) / GEN_BATCH) * GEN_LEN


# What a stage's phase scales with (eectl/phases.py): the budget's size of that name. The pipeline's verdict scales
# a phase's time by the next budget's size over this one's. Measured on a CPU (docs/results/2026-12-03-budgets.md):
# a batch of continuations costs per decode step, hardly per row (quick's 25 rows ran at ~20-40 tokens/s, standard's
# 64 at ~98), and a head-training step hardly more at 64 tokens than at 32, so those two scale with steps.
SIZES: dict[str, Callable[[Budget], float]] = {
    "profile_tokens": lambda b: b.profile_tokens,
    "text_tokens": lambda b: b.text_tokens,  # the state cache's teacher-forced training tokens
    "gen_steps": lambda b: _steps(b.gen_tokens),  # its decode steps
    "train_steps": lambda b: b.cache_tokens // b.batch_tokens,  # head training's optimiser steps
    "probe_tokens": lambda b: b.probe_tokens,
    "calibrate_tokens": lambda b: b.calibrate_tokens,
    # calibrate's continuations: decode steps too (GEN_LEN each, GEN_BATCH prompts together)
    "calibrate_gen_steps": lambda b: _steps(round(b.calibrate_tokens * CALIBRATE_GEN_SHARE)),
    "bench_tokens": lambda b: b.bench_prompts * b.bench_tokens * b.bench_reps,  # the timed repetitions
    "bench_answers": lambda b: b.bench_prompts * b.bench_tokens,  # one pass over the prompts (agreement, sweep)
}


BUDGETS: dict[str, Budget] = {
    b.name: b
    for b in (
        # quick is the main job (README: under 6 minutes on a 2-core CPU). Against issue 63's 8.1 min it profiles 1,024
        # tokens (was 1,536: the logit lens over 30 layers is the profile's whole time) and re-times export's costs
        # for 10 s (was 20: the plan's undecided options run their conservative choice and say so); the state cache,
        # probes, calibration and bench keep their sizes (probes on 3,200 tokens left no exit reaching 0.99).
        Budget(
            "quick",
            profile_tokens=1024,
            cache_tokens=6400,
            gen_share=0.25,
            batch_tokens=32,
            probe_tokens=6400,
            calibrate_tokens=6000,
            bench_prompts=5,
            bench_tokens=32,
            bench_reps=2,
            cost_seconds=10.0,
            about="a first look: every stage at small sizes (minutes on a laptop CPU)",
        ),
        Budget(
            "standard",
            profile_tokens=5120,
            cache_tokens=131072,
            gen_share=0.25,
            batch_tokens=64,
            probe_tokens=32768,
            calibrate_tokens=20000,
            bench_prompts=8,
            bench_tokens=32,
            bench_reps=2,
            cost_seconds=60.0,
            about="heads worth exporting: 20x quick's training tokens (tens of minutes on a CPU, minutes on a GPU)",
        ),
        Budget(
            "thorough",
            profile_tokens=20000,
            cache_tokens=1_000_000,
            gen_share=0.25,
            batch_tokens=64,
            probe_tokens=262144,
            calibrate_tokens=100000,
            bench_prompts=20,
            bench_tokens=64,
            bench_reps=4,
            cost_seconds=120.0,
            about="the studies' sizes: 1M training tokens (hours on a CPU; a GPU recommended)",
        ),
    )
}


def get_budget(name: str) -> Budget:
    if name not in BUDGETS:
        raise UsageError(f"unknown budget '{name}'", hint=f"choose one of {', '.join(BUDGETS)}")
    return BUDGETS[name]


def next_budget(name: str) -> Budget | None:
    names = list(BUDGETS)
    i = names.index(name)
    return BUDGETS[names[i + 1]] if i + 1 < len(names) else None


# The int4 twin's revision (models/int4.py): 2 since its projections quantize their inputs as the kernel does at
# accuracy level 4; 3 since a GGUF's per-block mins go into integer zero points (models/gguf_blocks.py). A new
# revision gets a state cache folder of its own and keys the pipeline's cached heads and calibrations, so nothing
# fitted against an earlier twin is reused.
TWIN_REVISION = 3


def states_folder(recipe_name: str, data_source: str, weights: str = "fp32") -> str:
    """Where a budget's state cache lives by default: one folder per recipe, data and weights, so budgets extend one
    another's and other data or the int4 twin gets a cache of its own (a cache refuses what it was not built
    from)."""
    import hashlib
    from pathlib import PurePath

    tag = hashlib.sha256(data_source.encode()).hexdigest()[:6]
    twin = "" if weights == "fp32" else f"-{weights}-twin{TWIN_REVISION}"
    return f"artifacts/{recipe_name}-states-{PurePath(data_source).stem}-{tag}{twin}"
