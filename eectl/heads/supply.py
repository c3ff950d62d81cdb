"""Does the data hold what a state cache asks of it? Checked before any stage runs, so a budget the data cannot fill
is one clear refusal, not a cache that silently holds less than its budget.

A state cache's training tokens are teacher-forced chunks of the data's training records and the model's own greedy
continuations (at most GEN_LEN tokens each) of their prompts; its held-out split takes the data's last records.
What this module does not do: build the cache (heads/state_cache_build.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eectl.contracts.budgets import prompts_needed
from eectl.contracts.recipe import Recipe
from eectl.data import TextData, count_tokens
from eectl.errors import DataError


@dataclass
class Supply:
    prompts: int  # prompts the data holds
    prompts_needed: int  # training continuations + the held-out records' (an estimate from below: EOS ends rows early)
    text_tokens: int  # tokens of the data's text, counted up to what is needed
    text_needed: int  # teacher-forced training + held-out tokens

    @property
    def enough(self) -> bool:
        return self.prompts >= self.prompts_needed and self.text_tokens >= self.text_needed


def cache_supply(tokenizer: Any, data: TextData, recipe: Recipe) -> Supply:
    """What the recipe's state cache (heads.tokens, gen_share, eval_tokens) needs of `data`, and what it has."""
    h = recipe.heads
    text_needed = h.tokens - round(h.tokens * h.gen_share) + h.eval_tokens
    needed = prompts_needed(h.tokens, h.gen_share, h.eval_tokens)
    return Supply(len(data.prompts), needed, count_tokens(tokenizer, data, text_needed), text_needed)


def check_supply(tokenizer: Any, data: TextData, recipe: Recipe) -> Supply:
    """The supply, or one DataError line saying what the budget needs, what the data has and what to do."""
    s = cache_supply(tokenizer, data, recipe)
    if s.enough:
        return s
    what = f"budget {recipe.budget}" if recipe.budget else f"a state cache of {recipe.heads.tokens} tokens"
    raise DataError(
        f"{what} needs at least {s.prompts_needed} prompts and {s.text_needed} tokens of text; {data.name} has "
        f"{s.prompts} prompts and {s.text_tokens}{'+' if s.text_tokens >= s.text_needed else ''} tokens",
        hint="pass --data with more prompts (a .jsonl or a text file; GSM8K train has 7,473), or a smaller --budget",
    )
