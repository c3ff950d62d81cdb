"""What a run is asked (`RunConfig`), what one row carries between steps (`RowState`) and what it returns
(`Generation`): the types the runner and the KV policies share.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from eectl.contracts.plan import MAX_NGRAM, VERIFY_BLOCK
from eectl.exits.signals import DEFAULT_SIGNAL
from eectl.runtime.sampling import RowSampling


@dataclass
class RunConfig:
    exits: list[int]  # active exit layers ([] = full depth)
    thresholds: dict[int, dict[str, float]]  # exit layer -> criterion -> threshold (exit when value >= it)
    signal: str = DEFAULT_SIGNAL
    policy: str = "defer"
    top_k: int = 64
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    verify_block: int = VERIFY_BLOCK  # verify: at most this many drafts before a forced full-depth pass
    # verify: up to this many drafts per step from n-gram matches of the context (runtime/drafts.py; 0: off), matched
    # on suffixes of at most `draft_ngram` tokens
    prompt_drafts: int = 0
    draft_ngram: int = MAX_NGRAM
    draft_min: int = 1  # the shortest run of drafts from the context proposed (the plan's: runtime/drafts.py)
    # drafts from the context: where the row's own context has no match, drafted from the latest this many tokens of
    # the runner's finished requests (runtime/draft_memory.py; 0: none, a run's default: DRAFT_MEMORY)
    draft_memory: int = 0
    # verify: the first active exit drafts ahead while the product of its top-1 probabilities over the run stays >= this
    # bound (runtime/ahead.py; 0: off, drafts where the exit's own test passes)
    draft_ahead: float = 0.0
    # batches (defer, verify): an exited row's deferred state joins the deeper segment calls that run anyway for other
    # rows (its K/V computed now, the same values a later flush computes) instead of waiting (chain_rows.py)
    ride_along: bool = True
    # batches: the rows' prompts run as one padded first-prompt call per segment (GQA's no-past case, runtime/batch.py
    # `run_prefill`) rather than one single-row call each. None: on non-CPU providers only; on the CPU EP a prompt
    # call is compute-bound and the padding costs what the shared call saves (default model, 16 HumanEval prompts
    # of 88-189 tokens: padded 14.7 s vs single-row 13.6 s)
    batch_prompts: bool | None = None
    # greedy steps with active exits or drafts executed as the binding plan says: the chain's buffers device memory,
    # hidden states, KV and logits staying there between graphs; only the exit tests' flags and tokens are read
    # (full-depth greedy steps keep their buffers where the graphs run anyway). None: on non-CPU providers (on the
    # CPU EP host buffers are the same memory, with less work per call)
    device_resident: bool | None = None
    # greedy tokens on the chain from the artifact's certified head where it has one (export/certified_head.py: the
    # full head's argmax, proven from an 8-bit ranking; a row it cannot prove runs the full head); False: the full
    # head every step
    certified_head: bool = True
    river_predict: str = "end"  # river: the token from the river's end (final head) or from the exit itself
    stop_ids: tuple[int, ...] = ()
    note: str = ""  # how the configuration was chosen (one line for run and bench)
    planned: bool = False  # exits and thresholds come from the manifest's plan
    certified: bool = False  # the setting of the artifact's sequence certificate (calibrate --guarantee sequence)


@dataclass
class LookupState:
    """One row's drafting state between steps (drafts from the context, runtime/drafts.py)."""

    span: int  # tokens to draft at the next attempt
    misses: int = 0  # attempts in a row that accepted nothing
    resume_at: int = 0  # no attempt before the row holds this many tokens
    drafted: int = 0
    accepted: int = 0
    attempts: int = 0
    step: tuple[int, int] = (0, 0)  # this step's attempt: (position of its first draft, drafts), until settled


@dataclass
class RowState:
    tokens: list[int]  # prompt + generated so far (the last one not yet processed)
    prompt_len: int
    pending: list[np.ndarray | None]  # per segment: [1, P, H] hidden at its input, or None
    drafts: list[tuple[int, int]] = field(default_factory=list)  # verify: (position, token) not yet checked
    exit_layers: list[int] = field(default_factory=list)  # per emitted token: the layer it was decided at
    latencies: list[float] = field(default_factory=list)  # per emitted token (seconds)
    forced: list[int] | None = None  # teacher forcing: the tokens to feed instead of the decided ones
    nll: list[float] = field(default_factory=list)  # teacher forcing: -log p(forced token) at the decided layer
    greedy: list[int] = field(default_factory=list)  # teacher forcing: the decided layer's argmax at each position
    decide_s: float = 0.0
    decided: dict[int, int] = field(default_factory=dict)  # exit layer -> decisions run there (gates skip some)
    picked: dict[int, int] = field(default_factory=dict)  # exit layer -> decisions that picked the candidates there
    drafted: int = 0
    rejected: int = 0
    lookup: LookupState | None = None  # prompt drafts (RunConfig.prompt_drafts): the row's drafting state
    reused: int = 0  # prompt tokens whose K/V the row's cache held already (not fed again: runtime/slots.py)
    done: bool = False
    # the row's own token budget (a server's request: runtime/feed.py); None: the run's (RunConfig.max_new_tokens)
    max_new_tokens: int | None = None
    # decode time of steps whose tokens are not emitted (drafts a rollback discarded): added to the next emitted
    # token's latency, so a row's latencies add up to its decode time
    carried_s: float = 0.0
    ahead: float = 1.0  # verify drafting ahead: the product of the run's draft probabilities (runtime/ahead.py)
    # the row's own sampling and generator (an engine's request: runtime/sampling.py); None: the run's
    # (RunConfig.temperature and top_p, the runner's generator)
    sampling: RowSampling | None = None

    def budget(self, run: int) -> int:
        """The tokens this row may generate: its own budget, else the run's (`run`)."""
        return run if self.max_new_tokens is None else self.max_new_tokens

    def emit(self, token: int, took: float) -> None:
        """Append a token decided in a step of `took` seconds (plus the time carried from discarded steps)."""
        self.tokens.append(token)
        self.latencies.append(took + self.carried_s)
        self.carried_s = 0.0

    def discard(self, pos: int) -> None:
        """Drop the tokens from position `pos` on (a rollback); their steps' time is carried to the next token."""
        keep = pos - self.prompt_len  # generated tokens before `pos`
        self.carried_s += float(sum(self.latencies[keep:]))
        del self.tokens[pos:]
        del self.exit_layers[keep:]
        del self.latencies[keep:]

    def generation(self) -> Generation:
        """What the row generated, for the caller (its prompt, tokens, where each was decided, timings, drafts)."""
        return Generation(
            prompt_ids=self.tokens[: self.prompt_len],
            token_ids=self.tokens[self.prompt_len :],
            exit_layers=self.exit_layers,
            ttft_s=self.latencies[0],
            latencies_s=self.latencies,
            decide_s=self.decide_s,
            total_s=float(sum(self.latencies)),
            drafted=self.drafted,
            rejected_drafts=self.rejected,
            prompt_drafted=self.lookup.drafted if self.lookup is not None else 0,
            prompt_accepted=self.lookup.accepted if self.lookup is not None else 0,
            decided=dict(self.decided),
            picked=dict(self.picked),
            reused=self.reused,
        )

    def count_decisions(self, decided: list[int], picked: int | None) -> None:
        for layer in decided:
            self.decided[layer] = self.decided.get(layer, 0) + 1
        if picked is not None:
            self.picked[picked] = self.picked.get(picked, 0) + 1


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    exit_layers: list[int]
    ttft_s: float
    latencies_s: list[float]
    decide_s: float  # time spent computing exit signals and decisions
    total_s: float
    drafted: int = 0  # verify: draft tokens proposed by exits
    rejected_drafts: int = 0  # verify: positions rolled back (drafts of either source and what followed them)
    prompt_drafted: int = 0  # verify: draft tokens proposed from the context (prompt lookup)
    prompt_accepted: int = 0  # verify: those the full model agreed with
    decided: dict[int, int] = field(default_factory=dict)  # exit layer -> decisions run there
    picked: dict[int, int] = field(default_factory=dict)  # exit layer -> decisions that picked candidates there
    reused: int = 0  # prompt tokens the cache held from an earlier prompt (its slot's or another row's: not fed)

    @property
    def tokens_per_s(self) -> float:
        decode = sum(self.latencies_s[1:])
        return (len(self.token_ids) - 1) / decode if decode > 0 and len(self.token_ids) > 1 else 0.0

    def mean_layers(self, num_layers: int) -> float:
        return float(np.mean(self.exit_layers)) if self.exit_layers else float(num_layers)
