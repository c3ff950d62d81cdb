"""`eectl pipeline --dry-run`: check a recipe against its model and print what the main job would run.

Loads the model (a local folder, a .gguf, or a hub id transformers can resolve) and the data, and checks what would
otherwise fail minutes into a run: the family the recipe names, the exits against the layer count, the signal, Top-K
against the vocabulary, the head design, the bench configurations. Runs no stage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from eectl.errors import UsageError
from eectl.recipe import Recipe, default_exits


@dataclass
class Plan:
    recipe: str
    model: dict[str, Any]
    family: str
    num_layers: int
    exits: list[int]
    data: dict[str, Any]
    stages: list[tuple[str, str]] = field(default_factory=list)  # (stage, what it will do)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_pipeline(recipe: Recipe, model: str | None = None) -> Plan:
    from eectl.bench import CONFIGS
    from eectl.data import load_text_data
    from eectl.exits import CRITERIA
    from eectl.heads import check_design
    from eectl.models import load_model

    spec = model if model is not None else recipe.model
    loaded = load_model(spec)
    a = loaded.adapter
    L = a.num_layers
    if recipe.family is not None and a.family != recipe.family:
        raise UsageError(f"recipe {recipe.name} is for the {recipe.family} family, but the model is {a.family}")
    exits = list(recipe.exits) if recipe.exits else default_exits(L)
    bad = [e for e in exits if not 1 <= e < L]
    if bad:
        raise UsageError(f"recipe {recipe.name}: exit {bad[0]} is not in 1..{L - 1} for this {L}-layer model")
    if recipe.signal not in CRITERIA:
        raise UsageError(f"recipe {recipe.name}: unknown signal '{recipe.signal}'")
    if not 2 <= recipe.top_k <= a.dims.vocab_size:
        raise UsageError(f"recipe {recipe.name}: top_k {recipe.top_k} not in 2..{a.dims.vocab_size}")
    check_design(recipe.heads.design, recipe.heads.rank)
    unknown = [c for c in recipe.bench.configs if c not in CONFIGS]
    if unknown:
        raise UsageError(f"recipe {recipe.name}: unknown bench configuration '{unknown[0]}'")
    text = load_text_data(recipe.data.source, recipe.data.field)
    profile_tokens = recipe.profile.tokens or recipe.data.tokens
    h, b = recipe.heads, recipe.bench
    stages = [
        (
            "profile",
            f"{profile_tokens} tokens of {text.name}, alpha {recipe.profile.alpha}, {recipe.profile.similarity}",
        ),
        ("train-heads", f"{h.design} heads at exits {exits}, {h.steps} steps, {h.eval_tokens} held-out tokens"),
        ("calibrate", f"{recipe.signal} (K={recipe.top_k}) to {recipe.target} on {recipe.data.tokens} tokens"),
        ("export", f"{len(exits) + 1} segments, exits {exits}, fp32"),
        ("run", f"one sample prompt, policy {recipe.kv_policy}"),
        (
            "bench",
            f"{', '.join(b.configs)}; {b.prompts} prompts x {b.max_new_tokens} tokens x {b.reps} reps, "
            f"perplexity on {b.ppl_tokens} tokens, sweep {b.sweep or 'none'}",
        ),
    ]
    return Plan(
        recipe.name,
        {**loaded.source.to_dict()},
        a.family,
        L,
        exits,
        {**text.to_dict()},
        stages,
    )
