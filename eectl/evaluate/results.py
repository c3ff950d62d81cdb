"""The bench's options and its result schema (what bench writes and the report reads)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from eectl.contracts.certificate import CERTIFIED
from eectl.contracts.names import POLICY_SPECS, default_policies
from eectl.contracts.plan import DRAFT_MEMORY, LOOKUP, RIVER_EXIT
from eectl.plan.ahead import AHEAD
from eectl.runtime.tiers import WeightOptions

AA = "full-aa"  # the A/A control: a second copy of full depth (evaluate/bench.py adds it to every run)
BASELINES = ("hf", "full", AA)  # every other configuration is a KV policy's name (eectl.runtime.policies) or:
# LOOKUP: full depth with drafts from the context (prompt lookup) checked by verify's pass
VERIFY_LOOKUP = "verify+lookup"  # verify's exit drafts and drafts from the context together
LOOKUP_CONFIGS = (LOOKUP, VERIFY_LOOKUP)
# CERTIFIED: the setting of the artifact's sequence certificate (calibrate --guarantee sequence)
EXACT_HEAD = "exact-head"  # full depth with the full LM head every step: what the certified head saves (export/)
# every configuration bench runs by its name (--compare adds the user's): what --policies and a recipe's bench.configs
# may list
# AHEAD: verify drafting ahead at the bound plan/ahead.py picks (evaluate/ahead.py)
BUILT_IN_CONFIGS = (*BASELINES, *POLICY_SPECS, RIVER_EXIT, *LOOKUP_CONFIGS, AHEAD, CERTIFIED, EXACT_HEAD)
DRAFTING_CONFIGS = (*LOOKUP_CONFIGS, AHEAD)  # configurations of drafts checked by verify: full depth's tokens


@dataclass
class BenchOptions:
    configs: list[str] = field(default_factory=lambda: [*BASELINES, *default_policies()])
    prompts: int = 10
    max_new_tokens: int = 64
    reps: int = 3
    exits: str | None = None  # active exits for the early-exit configurations (default: the calibrated ones)
    signal: str | None = None  # exit signal (default: the calibration's)
    thresholds: str | None = None
    threshold_scale: float = 1.0
    sweep: list[float] = field(default_factory=lambda: [0.9, 1.0, 1.1])  # threshold scales for the trade-off plot
    ppl_tokens: int = 1024
    provider: str = "auto"
    threads: int | None = None
    raw: bool = False
    batch_size: int = 1  # prompts per eectl generate call (rows in lock-step, one graph call per segment); hf: 1
    profile_costs: bool = False  # re-measure the graph costs here and re-plan before benchmarking
    max_risk: float | None = None  # the plan's default may be a certified lossy setting up to this risk (run's)
    compare: dict[str, str] = field(default_factory=dict)  # config name -> another artifact, run at full depth
    # runtime -> GGUF (evaluate/peers.py): llama.cpp beside eectl, as configurations `llama.cpp`, `llama.cpp+lookup`
    peers: dict[str, str] = field(default_factory=dict)
    prompt_drafts: int | None = None  # the lookup configurations' drafts per step (None: the plan's, else 12)
    draft_memory: int = DRAFT_MEMORY  # the lookup configurations' memory of earlier requests (runtime/draft_memory.py)
    weights: WeightOptions = field(default_factory=WeightOptions)  # mapped weights, memory budget, placement
    # the ahead configuration: the prompts its drafter is replayed on (not timed), and a bound pinned (None: the plan's)
    ahead_prompts: list[str] = field(default_factory=list)
    ahead_replay: int = 8  # how many (evaluate/stage.py takes them from the data)
    draft_ahead: float | None = None


@dataclass
class ConfigResult:
    name: str
    ms_per_token: float  # median over reps of (decode time / decoded tokens)
    ms_per_token_spread: tuple[float, float]  # min, max over reps
    tokens_per_s: float  # per row: 1000 / ms_per_token
    throughput: float  # decoded tokens per second over all rows of a batch (median over reps)
    ttft_ms: float  # median over prompts and reps
    rss_mb: float  # process RSS after this configuration's runs (cumulative peak: see the notes)
    speedup_vs_full: float | None = None  # per-row latency ratio
    throughput_vs_full: float | None = None  # all-rows throughput ratio, at the same batch size
    speedup_vs_hf: float | None = None
    mean_layers: float | None = None
    layer_bound: float | None = None  # L / mean executed layers
    decide_share: float | None = None  # share of decode time spent computing exit signals
    token_agreement: float | None = None  # vs eectl full depth, position-wise over generated tokens
    exact_match: float | None = None
    first_divergence: float | None = None  # mean index of the first differing token (len when none)
    # against the fp32 reference (BenchResult.fp32_reference): the mean index of the first differing token, and the
    # share of the reference's tokens generated before it (the tokens equal to the fp32 model's before a divergence)
    fp32_first_divergence: float | None = None
    fp32_prefix_share: float | None = None
    perplexity: float | None = None
    gsm8k_accuracy: float | None = None
    exit_histogram: dict[str, int] = field(default_factory=dict)
    drafted: int = 0  # verify: drafts from the exits (first repetition)
    rejected: int = 0  # verify: positions rolled back, drafts of either source
    prompt_drafted: int = 0  # drafts from the context (runtime/drafts.py; first repetition) and those accepted
    prompt_accepted: int = 0
    # 95% intervals over prompts (the unit that varies): bootstrap of token agreement, Wilson score interval of exact
    # match. The speedup's: the interval its reading uses (stats.widened): the paired bootstrap interval widened on
    # both sides by the run's A/A reach (`resolution`), raw when there is none; the A/A control's own is raw (it
    # defines the reach and the gate). `speedup_vs_full_sampling_ci`: the paired bootstrap interval, never widened.
    speedup_vs_full_ci: tuple[float, float] | None = None
    speedup_vs_full_sampling_ci: tuple[float, float] | None = None
    token_agreement_ci: tuple[float, float] | None = None
    exact_match_ci: tuple[float, float] | None = None
    exits: list[int] = field(default_factory=list)  # the active exits of this configuration
    # exit decisions run per decode step (all exits together; a gate skips some: eectl.exits.gates), and whether gated
    decisions_per_step: float | None = None
    gated: bool = False
    predicted_speedup: float | None = None  # the plan's prediction (held-out coverage, the manifest's costs)
    # its 90% interval over the costs' timing rounds (plan/choose.py)
    predicted_interval: tuple[float, float] | None = None
    model_speedup: float | None = None  # the cost model at this run's realized exits (and rollbacks)
    # copy/defer as planned: the token agreement the calibrated option implies over this run's continuation length
    predicted_agreement: float | None = None
    # per token on the configuration's own path: the share of its generated tokens that full depth chooses after the
    # same prefix (what calibrate's target bounds; position-wise agreement compounds the first difference), with its
    # 95% interval over prompts, and the calibrated option's held-out per-token agreement it is checked against
    step_agreement: float | None = None
    step_agreement_ci: tuple[float, float] | None = None
    predicted_step_agreement: float | None = None
    note: str = ""  # how the configuration was chosen
    # whether this run can tell this configuration's speed from noise: `conclusive`, `inconclusive: <reason>`, or
    # `the baseline` (stats.noise_verdict: the A/A control's interval against AA_BAND)
    verdict: str = ""
    # in a conclusive run, what it says of this configuration's speed (stats.speed_reading): `faster`, `slower`, or
    # `no difference beyond +-X%` (its interval reaches into the A/A control's spread); "" otherwise
    reading: str = ""
    # the timed runs: per repetition, per block of prompts (decode seconds, decode tokens, decode wall seconds),
    # what every speed ratio above is computed from
    blocks: list[list[tuple[float, int, float]]] = field(default_factory=list)
    # "full" where the configuration runs exactly full depth (its plan cleared no exit, and it drafts nothing): the
    # row is full depth's figures, not timed apart (configs.Configs.at_full_depth); "" for a timed row
    timed_as: str = ""
    runtime: str = ""  # "" for eectl's configurations (and hf's transformers); a peer's runtime: "llama.cpp"


@dataclass
class BenchResult:
    artifact: str
    model: str
    provider: str
    threads: int
    prompts: int
    max_new_tokens: int
    reps: int
    batch_size: int
    signal: str
    exits: list[int]
    thresholds: dict[str, dict[str, float]]
    configs: list[ConfigResult]
    sweep: list[dict[str, Any]]
    hf_matches_full: bool | None
    notes: list[str] = field(default_factory=list)
    default: str = ""  # the configuration `eectl run` uses by default (the plan's: a policy or full), if planned
    plan: str = ""  # the plan's one-line summary
    river_kv: dict[str, Any] | None = None  # river_kv_cosine on the first prompt
    # full depth's decode here against the step the plan was priced with, and a note where they differ
    # (evaluate/predicted.py `conditions`)
    conditions: dict[str, Any] | None = None
    reps_run: int = 0  # repetitions timed: --reps, plus those the noise gate added
    verdict: str = ""  # the run's: `conclusive` or `inconclusive: <reason>` (stats.noise_verdict)
    aa_band: tuple[float, float] = (0.97, 1.03)
    other_load: float | None = None  # CPU cores other processes kept busy during the timed phase (from /proc)
    resolution: float | None = None  # the A/A interval's reach from 1.0: speedups within 1 +- this are noise here
    certificate: str = ""  # the artifact's sequence certificate, as a sentence
    certificate_check: str = ""  # its risk realized on this run's prompts, and whether it sits inside the bound
    memory: dict[str, Any] | None = None  # --mmap-weights/--memory-budget: tiers, resident memory, bytes per token
    # --compare: per repetition, per block, the runtime instance every configuration ran that block on (0: each
    # artifact's first-created runtime, 1: its mirrored second; evaluate/configs.py); None without --compare
    block_instances: list[list[int]] | None = None
    # the configuration whose tokens are the fp32 model's (full depth of an fp32 artifact: this one's, or the first
    # compared one's), which every row's fp32_* fidelity is measured against; None when no fp32 artifact ran
    fp32_reference: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
