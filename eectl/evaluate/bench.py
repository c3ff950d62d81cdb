"""`eectl bench`: speed and fidelity of early exit against full depth, side by side, in one run.

Every speed figure is a ratio against baselines measured in the same run, with the configurations interleaved
(A B C A B C ...) after a warm-up, because absolute times on shared machines drift:

- `hf`:   transformers' own greedy `generate` on the same prompt ids and thread count (torch),
- `full`: eectl's exported graphs at full depth (ONNX Runtime),
- `full-aa`: a second copy of `full` (the A/A control, always run): its ratio to `full` is the run's noise floor,
- `copy`, `defer`, `verify`, `river`: early exit with the artifact's calibrated thresholds (or --thresholds), the
  same exits and signal for each, so they differ only in what follows an exit; `river-exit` is `river` with the
  token predicted at the exit instead of the river's end (river's K/V are also compared with the exact K/V),
- `lookup`: full depth with drafts from the context (prompt lookup, runtime/drafts.py) checked by verify's deep
  pass; `verify+lookup`: verify's exit drafts and drafts from the context together (both lossless),
- any other artifact of the same model at full depth (`compare`, e.g. an int4 export: `--compare int4=PATH`),
- peers (`--peer llama.cpp=FILE.gguf`, evaluate/peers.py): llama.cpp on the same prompt ids, plain and with its
  prompt-lookup decoding, run apart like `hf`.

Fidelity is measured against eectl full depth on the same prompts (token agreement, exact match, first
divergence), and, where an fp32 artifact ran (this one or a compared one; else `hf`, the checkpoint in float32),
against its tokens: the share of them each configuration generated before its first divergence (`fp32_reference`);
teacher-forced perplexity on held-out text, and GSM8K final-answer accuracy when the data has `#### answer` lines.
Speed is one statistic, with its interval (evaluate/stats.py); the report is evaluate/report.py; the configurations'
runners and a pass over the prompts evaluate/configs.py, the timed phase evaluate/timing.py.
What this module does not do: export or calibrate.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from eectl.contracts.certificate import CERTIFIED
from eectl.contracts.manifest import Manifest
from eectl.contracts.plan import MAX_DRAFTS
from eectl.data import encode_prompt
from eectl.errors import UsageError
from eectl.evaluate.configs import Configs, as_full_depth, open_runtime, threshold_sweep
from eectl.evaluate.fidelity import accuracy, certificate_check, fp32_fidelity
from eectl.evaluate.peers import check_peers, open_peers, peer_context, peer_note, peer_specs
from eectl.evaluate.predicted import RIVER_EXIT, conditions, lookup_model, predictions, run_default
from eectl.evaluate.report import markdown, write_report
from eectl.evaluate.results import (
    AA,
    BUILT_IN_CONFIGS,
    DRAFTING_CONFIGS,
    EXACT_HEAD,
    VERIFY_LOOKUP,
    BenchOptions,
    BenchResult,
    ConfigResult,
)
from eectl.evaluate.river_kv import river_kv_cosine
from eectl.evaluate.stats import (
    AA_BAND,
    agreement,
    agreement_ci,
    block_ratios,
    noise_verdict,
    per_prompt_totals,
    ratio_ci,
    ratio_estimate,
    seconds_per_token,
    share_ci,
    speed_reading,
    widened,
    wilson,
)
from eectl.evaluate.timing import _aa_interval, _gate_reps, _gated, _Run, _Timing
from eectl.phases import Phases
from eectl.run.generate import RunOptions, check_options, choose_plan, load_tokenizer
from eectl.run.thresholds import check_exit_options_used
from eectl.runtime.policies import POLICIES
from eectl.runtime.sessions import ArtifactRuntime

__all__ = ["markdown", "write_report"]  # the report's entry points, re-exported for the CLI


def bench_units(opts: BenchOptions, prompts: int) -> int:
    """How many progress units run_bench reports: one per prompt generated (the noise gate's extra repetitions
    included at their most: the units of those that do not run are counted once the gate is done), one per
    perplexity pass."""
    sweep = len(opts.sweep) * 2 * prompts if any(c in POLICIES for c in opts.configs) else 0
    return sum(config_units(c, opts, prompts) for c in set(opts.configs) | {"full", AA}) + sweep


def config_units(name: str, opts: BenchOptions, prompts: int) -> int:
    """One configuration's part of bench_units: a warm-up prompt per runtime instance, its timed prompts, a
    perplexity pass where its policy scores text, its step agreement where its tokens may differ from full depth's."""
    scored = name == "full" or (name in POLICIES and POLICIES[name].scores_text)
    ppl = 1 if scored and opts.ppl_tokens > 0 else 0
    steps = prompts if _changes_tokens(name) else 0
    return (2 if opts.compare else 1) + (opts.reps + _gate_reps(opts.reps)) * prompts + ppl + steps


def add_artifact_configs(opts: BenchOptions, m: Manifest) -> None:
    """The configurations every bench of this artifact runs beside the asked ones: its default (lookup, ahead) and
    the setting of its sequence certificate, checked on the bench's prompts. Called before the progress total is
    counted (bench_units) and again once the plan is settled."""
    if not opts.configs:  # a bench of nothing: refused by its own check (_check_options), not filled in here
        return
    if m.plan is not None and m.plan.default in DRAFTING_CONFIGS and m.plan.default not in opts.configs:
        opts.configs.append(m.plan.default)
    if (cert := m.certificate) is not None and cert.certified and CERTIFIED not in opts.configs:
        opts.configs.append(CERTIFIED)
    certified_head = m.exits[-1].certified is not None and opts.provider in ("auto", "cpu")  # fp32 only: CPU EP
    if certified_head and EXACT_HEAD not in opts.configs:  # what the certified head saves, beside full depth
        opts.configs.append(EXACT_HEAD)


def _changes_tokens(name: str) -> bool:
    """Whether a configuration's tokens may differ from full depth's (a lossless policy's never do)."""
    if name in ("full", AA, "hf", EXACT_HEAD, *DRAFTING_CONFIGS):
        return False
    return name not in POLICIES or not POLICIES[name].lossless


def heldout_texts(texts: list[str]) -> list[str]:
    """The last tenth of the records (at least one): the text teacher-forced perplexity is measured on."""
    return texts[-max(1, len(texts) // 10) :]


def _summary(name: str, reps: list[_Run], rss: float, num_layers: int, runtime: str = "") -> ConfigResult:
    """Speed of one configuration over its repetitions (one statistic: total decode time over total decode tokens,
    every prompt and repetition pooled), and (eectl configurations: no `runtime`) where its tokens exited."""
    per_rep = [1000 * seconds_per_token(per_prompt_totals([r.per_prompt])) for r in reps]
    ms = 1000 * seconds_per_token(per_prompt_totals([r.per_prompt for r in reps]))
    res = ConfigResult(
        name=name,
        ms_per_token=ms,
        ms_per_token_spread=(min(per_rep), max(per_rep)),
        tokens_per_s=1000 / ms if ms > 0 else 0.0,
        throughput=_throughput(reps),
        ttft_ms=1000 * float(np.median([t for r in reps for t in r.ttfts])),
        rss_mb=round(rss, 1),
        runtime=runtime,
    )
    if name != "hf" and not runtime:
        layers = reps[0].exit_layers
        res.mean_layers = float(np.mean(layers)) if layers else float(num_layers)
        res.layer_bound = num_layers / res.mean_layers
        res.exit_histogram = {str(k): int(v) for k, v in sorted(Counter(layers).items())}
        decode = sum(sum(r.latencies) for r in reps)
        res.decide_share = sum(r.decide_s for r in reps) / decode if decode > 0 else 0.0
        steps = sum(len(r.exit_layers) + r.rejected for r in reps)
        res.decisions_per_step = sum(sum(r.decided.values()) for r in reps) / steps if steps else None
        res.drafted = reps[0].drafted
        res.rejected = reps[0].rejected
        res.prompt_drafted = reps[0].prompt_drafted
        res.prompt_accepted = reps[0].prompt_accepted
    return res


def _throughput(reps: list[_Run]) -> float:
    """Decoded tokens of all rows per second of decode wall time, every repetition pooled."""
    wall = sum(r.decode_wall_s for r in reps)
    return sum(r.decode_tokens for r in reps) / wall if wall > 0 else 0.0


def _perplexities(configs: Configs, results: list[ConfigResult], tok: Any, heldout: list[str], log: Any) -> None:
    """Teacher-forced perplexity of every configuration whose policy can score text; a lossless policy's is full
    depth's by construction."""
    text_ids = _heldout_ids(tok, heldout, configs.opts.ppl_tokens, configs.rt.manifest.max_positions)
    if log is not None:
        log.log(f"teacher-forced perplexity on {len(text_ids)} held-out tokens")
    by = {r.name: r for r in results}
    for r in results:
        policy = "river" if r.name == RIVER_EXIT else r.name
        if r.name == "full" or r.name in configs.opts.compare or (policy in POLICIES and POLICIES[policy].scores_text):
            nll, _ = configs.runners[r.name].score(text_ids, prompt_len=1)
            r.perplexity = math.exp(float(np.mean(nll)))
            configs.tick(1)
    for r in results:
        if r.name in POLICIES and POLICIES[r.name].lossless:
            r.perplexity = by["full"].perplexity


def _step_agreements(
    configs: Configs, runs: dict[str, list[_Run]], ids: list[list[int]], results: list[ConfigResult]
) -> None:
    """Per-token agreement of each configuration that may change the tokens, on its own path: full depth
    teacher-forced over each prompt + the configuration's first-repetition tokens chooses, after every prefix, the
    token it would emit; the share equal to the configuration's (pooled over prompts, bootstrap interval). This is
    the quantity calibrate's target (e.g. 0.99) is about, where position-wise agreement compounds the first
    difference over the continuation."""
    full = configs.runners["full"]
    for r in results:
        if not _changes_tokens(r.name):
            continue
        same, total = [], []
        for prompt, gen in zip(ids, runs[r.name][0].generations, strict=True):
            want = full.greedy_choices(prompt + gen, len(prompt)) if gen else []
            same.append(sum(a == b for a, b in zip(gen, want, strict=True)))
            total.append(len(gen))
            configs.tick(1)
        if sum(total):
            r.step_agreement = sum(same) / sum(total)
            r.step_agreement_ci = share_ci(np.array(same), np.array(total))


def run_bench(
    artifact: str | Path,
    prompts: list[str],
    opts: BenchOptions,
    heldout: list[str] | None = None,
    answers: list[str | None] | None = None,
    log: Any = None,
    progress: Callable[[int], None] | None = None,
    phases: Phases | None = None,
) -> BenchResult:
    """Run the configurations interleaved; `progress(1)` after each prompt generated and each perplexity pass
    (bench_units gives the total). `phases` gets where the time went, each part with the budget size it scales
    with (eectl/phases.py)."""
    _check_options(opts, prompts)
    phases = phases if phases is not None else Phases()
    t0 = time.perf_counter()
    rt = open_runtime(artifact, opts)
    choose_plan(rt, opts.profile_costs, opts.max_risk, log.log if log is not None else None, opts.max_new_tokens)
    m = rt.manifest
    add_artifact_configs(opts, m)
    tok = load_tokenizer(rt)
    ids = [encode_prompt(tok, p, opts.raw) for p in prompts[: opts.prompts]]
    configs = Configs(rt, opts, tuple(m.eos_token_ids), progress, _peers(opts, rt, tok, ids))
    phases.add("open the artifact", time.perf_counter() - t0)
    names, order = _orders(configs, log)
    with phases.time("timed repetitions", "bench_tokens"):
        timing = _gated(configs, order, ids, opts, log)
    phases.add("timed repetitions", -timing.warmup_s)
    phases.add("warm-up", timing.warmup_s)
    runs = timing.runs
    verdict, resolution, load = _noise(timing)
    full_tokens = runs["full"][0].generations
    results = [_result(name, timing, configs, tok, answers, verdict) for name in order]
    _readings(results, verdict, resolution)
    fp32_reference = fp32_fidelity(configs, results, runs)
    with phases.time("agreement", "bench_answers"):
        _lookup_models(configs, results, ids, runs)
        _step_agreements(configs, runs, ids, results)
    if heldout:
        with phases.time("perplexity"):  # bench.ppl_tokens: the same in every budget
            _perplexities(configs, results, tok, heldout, log)
    river_kv = _river_kv(configs, ids, log)
    with phases.time("threshold sweep", "bench_answers"):
        sweep = threshold_sweep(configs, ids, full_tokens)
    default, plan_line = run_default(m.plan, opts.batch_size)
    for line in configs.memory.lines() if log is not None else []:
        log.log(line)
    results = _with_full_depth_rows(configs, results, names, len(ids))
    return BenchResult(
        artifact=str(artifact),
        default=default,
        plan=plan_line,
        model=str(m.model.get("name")),
        provider=rt.provider,
        threads=rt.threads,
        prompts=len(ids),
        max_new_tokens=opts.max_new_tokens,
        reps=opts.reps,
        batch_size=opts.batch_size,
        signal=configs.signal,
        exits=configs.exits,
        thresholds={str(k): v for k, v in configs.thresholds.items()},
        configs=results,
        sweep=sweep,
        hf_matches_full=runs["hf"][0].generations == full_tokens if "hf" in runs else None,
        notes=_notes(rt, opts),
        river_kv=river_kv,
        conditions=conditions(m.costs, results[0].ms_per_token, ids, full_tokens, opts.batch_size),  # [0]: full
        reps_run=len(runs["full"]),
        verdict=verdict,
        aa_band=AA_BAND,
        other_load=None if load is None else round(load, 3),
        resolution=resolution,
        certificate=m.certificate.describe() if m.certificate is not None else "",
        certificate_check=certificate_check(m.certificate, runs, tok, answers, opts.max_new_tokens),
        memory=configs.memory.section(),
        block_instances=timing.instances if timing.paired_instances else None,
        fp32_reference=fp32_reference,
    )


def _peers(opts: BenchOptions, rt: ArtifactRuntime, tok: Any, ids: list[list[int]]) -> dict[str, Any]:
    """The --peer runtimes (evaluate/peers.py), each given the prompt ids' longest context and the tokenizer."""
    encode = lambda text: [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]  # noqa: E731
    context = peer_context(ids, opts.max_new_tokens)
    return open_peers(peer_specs(opts.peers), rt.threads, context, encode, rt.manifest.dims.get("vocab_size"))


def _orders(configs: Configs, log: Any) -> tuple[list[str], list[str]]:
    """The report's order of the configurations and the order the timed ones run in (after the configurations'
    notes in the log): the A/A control always runs, the Williams design putting it and full at different positions
    in every order; a configuration that runs exactly full depth is not timed again (its row is full depth's)."""
    opts, alike = configs.opts, configs.at_full_depth()
    if log is not None:
        for cfg in configs.configs.values():
            if cfg.note:
                log.log(cfg.note)
        if opts.compare:
            log.log(COMPARE_NOTE)
        if alike:
            log.log(f"{', '.join(alike)}: the plan runs them at full depth; the full row is theirs (not timed apart)")
    names = ["full", AA, *[c for c in opts.configs if c not in ("full", AA)]]
    return names, [c for c in names if c not in alike]


def _with_full_depth_rows(
    configs: Configs, results: list[ConfigResult], names: list[str], prompts: int
) -> list[ConfigResult]:
    """`results` (the timed configurations') with the rows of those that run full depth, full depth's figures under
    their names, in the report's order; their progress units, which never ran, counted."""
    alike = [c for c in names if c not in {r.name for r in results}]
    configs.tick(sum(config_units(c, configs.opts, prompts) for c in alike))
    rows = {r.name: r for r in results} | {c: as_full_depth(results[0], c, configs.configs[c]) for c in alike}
    return [rows[c] for c in names]


def _noise(timing: _Timing) -> tuple[str, float | None, float | None]:
    """The run's noise: its verdict (from the A/A control's interval), the smallest speedup it can tell from noise,
    and the other processes' mean load when that was measured."""
    aa_ci, n_ratios = _aa_interval(timing)
    verdict = noise_verdict(aa_ci, n_ratios)
    # the smallest speedup this run can tell from noise: how far the A/A control's interval reaches from 1
    # (rounded as the report states it: the widened intervals and the readings use the value the JSON carries)
    resolution = round(max(1.0 - aa_ci[0], aa_ci[1] - 1.0), 4) if all(math.isfinite(x) for x in aa_ci) else None
    load = float(np.mean(timing.load)) if timing.load else None
    if verdict != "conclusive" and load is not None:
        verdict += f" (other processes kept {load:.2f} cores busy on average)"
    return verdict, resolution, load


def _readings(results: list[ConfigResult], verdict: str, resolution: float | None) -> None:
    """Each configuration but full and its A/A copy: its reported interval, the sampling interval widened by the
    run's A/A reach (stats.widened), and in a conclusive run its reading (faster, slower or no difference), which
    says faster or slower exactly when that interval excludes 1.0. The A/A control keeps its sampling interval: it
    defines the reach and the gate."""
    for r in results:
        if r.name in ("full", AA):
            continue
        r.speedup_vs_full_ci = widened(r.speedup_vs_full_sampling_ci, resolution)
        if verdict == "conclusive":
            r.reading = speed_reading(r.speedup_vs_full_sampling_ci, resolution)


def _lookup_models(
    configs: Configs, results: list[ConfigResult], ids: list[list[int]], runs: dict[str, list[_Run]]
) -> None:
    """Drafts from the context at full depth: the cost model's speedup on this run's own answers."""
    for r in results:
        drafting = configs.configs.get(r.name)
        if drafting is not None and drafting.prompt_drafts and not drafting.exits:
            r.model_speedup = lookup_model(drafting, configs.rt.manifest, ids, runs[r.name][0].generations)


def _river_kv(configs: Configs, ids: list[list[int]], log: Any) -> dict[str, Any] | None:
    """River's K/V against the exact K/V of the same tokens, per layer, on the first prompt (None without river)."""
    if "river" not in configs.runners:
        return None
    if log is not None:
        log.log("river: its K/V against the exact K/V of the same tokens, per layer (first prompt)")
    return river_kv_cosine(configs.runners["river"], ids[0])


def _check_options(opts: BenchOptions, prompts: list[str]) -> None:
    """Every check that needs no artifact, before it loads: bench's own, and those `run` makes of the options every
    configuration's RunOptions carries (--signal, --exits, --thresholds, --prompt-drafts, --provider)."""
    built_in = BUILT_IN_CONFIGS
    peers = [p.name for p in peer_specs(opts.peers)]
    known = (*built_in, *opts.compare, *peers)
    clash = [c for c in opts.compare if c in (*built_in, *peers)]
    if clash:
        raise UsageError(f"--compare name '{clash[0]}' is a built-in or peer configuration; pick another name")
    check_peers(opts.peers)
    if not opts.configs:  # `--policies ''` (or ','): a bench of nothing
        raise UsageError("--policies names nothing", hint=f"choose from {', '.join(known)}")
    bad = [c for c in opts.configs if c not in known]
    if bad:
        raise UsageError(f"unknown configuration {bad[0]}; choose from {', '.join(known)}")
    if twice := sorted({c for c in opts.configs if opts.configs.count(c) > 1}):  # one runner would take two turns
        raise UsageError(f"--policies names {', '.join(twice)} more than once")
    counts = {"--reps": opts.reps, "--prompts": opts.prompts, "--max-new-tokens": opts.max_new_tokens}
    if low := [(k, n) for k, n in {**counts, "--batch-size": opts.batch_size}.items() if n < 1]:
        raise UsageError(f"{low[0][0]} must be >= 1, got {low[0][1]}")
    if opts.ppl_tokens < 0:
        raise UsageError(f"--ppl-tokens must be >= 0 (0: no perplexity), got {opts.ppl_tokens}")
    if opts.prompt_drafts is not None and not 0 <= opts.prompt_drafts <= MAX_DRAFTS:  # as run checks it
        raise UsageError(f"--prompt-drafts must be in 0..{MAX_DRAFTS}, got {opts.prompt_drafts}")
    if not prompts:
        raise UsageError("no prompts to benchmark")
    if not all(x > 0 and math.isfinite(x) for x in [opts.threshold_scale, *opts.sweep]):
        raise UsageError("--threshold-scale and --sweep must be positive finite numbers")
    if opts.max_risk is not None and not 0 <= opts.max_risk < 1:
        raise UsageError(f"--max-risk must be in [0, 1), got {opts.max_risk}")
    shared = RunOptions(exits=opts.exits, signal=opts.signal, thresholds=opts.thresholds, provider=opts.provider)
    shared.prompt_drafts, shared.draft_memory = opts.prompt_drafts, opts.draft_memory
    check_options(shared)
    early = (*POLICIES, RIVER_EXIT, VERIFY_LOOKUP)
    check_exit_options_used(opts.exits, opts.thresholds, "--policies", opts.configs, early)


# Measured (docs/results/2026-12-03-bench.md): one artifact loaded three times in one process, full depth, steps
# taken in turn on one pinned thread: the 2nd runtime read 1.05-1.06x the 1st in five runs, the 3rd 1.09x. Not the
# step schedule, thread placement, malloc's mmap threshold, huge pages or runners sharing a runtime; cause unknown.
# What bench does about it: mirrored runtimes and per-instance medians (evaluate/configs.py Configs).
COMPARE_NOTE = (
    "--compare: runtimes were created in a mirrored order (this artifact, each compared artifact, the compared ones "
    "again in reverse, this artifact again), so each artifact's two runtimes have the same mean creation position, "
    "and every configuration alternated between its two runtimes block by block (all configurations of a block on "
    "the same one), each ratio's median taken per runtime and the two combined: a creation-order effect (in one "
    "process a runtime created later read faster, 1.05x for the second, 1.09x for the third, cause unknown) cancels "
    "instead of biasing a compared artifact's ratio; this artifact's runtime is held twice (double its memory)"
)


def _notes(rt: ArtifactRuntime, opts: BenchOptions) -> list[str]:
    """What the report's notes say about how this run ran."""
    m = rt.manifest
    notes = [
        f"{rt.threads} ONNX Runtime threads (one global pool); torch (hf) threads set to the same count",
        f"eectl configurations run {opts.batch_size} prompt(s) per batch (hf one at a time): ms/token is a row's "
        "latency per decode step, throughput counts decoded tokens of all rows per second of decode wall time",
        "RSS is the process's resident memory after each configuration's runs; ORT and torch share the process",
    ]
    notes += [m.plan.summary()] if m.plan is not None else []
    notes += [COMPARE_NOTE] if opts.compare else []
    notes += [peer_note(opts.peers, rt.threads)] if opts.peers else []
    if why := rt.certified_refused:
        notes.append(f"the certified final head is off on this machine: {why}")
    if m.costs is not None:
        notes.append(
            f"costs {_where_timed(opts, m.costs)} on {m.costs.provider} with "
            f"{m.costs.threads} threads (full-depth step {m.costs.full_step_ms:.1f} ms at a past of {m.costs.past})"
        )
    return notes


def _where_timed(opts: BenchOptions, costs: Any) -> str:
    if costs.memory_budget is not None:
        return f"re-measured here under the memory budget ({costs.memory_budget / 1e6:.0f} MB resident, the rest cold)"
    return "re-measured here" if opts.profile_costs else "measured at export"


def _paired(
    base: np.ndarray, other: np.ndarray, column: int = 0, instances: np.ndarray | None = None
) -> tuple[float | None, tuple[float, float]]:
    """The paired statistic of two [R, B, 3] block timings: median block ratio and its interval (per runtime
    instance under --compare: `instances`, [R, B]); column 0 compares decode seconds per token (latency), 2 wall
    seconds per token (throughput: a batch's rows share the wall)."""
    ratios = block_ratios(base[..., [column, 1]], other[..., [column, 1]])
    est = ratio_estimate(ratios, instances)
    return (est if math.isfinite(est) else None), ratio_ci(ratios, instances=instances)


def _result(
    name: str, timing: _Timing, configs: Configs, tok: Any, answers: list[str | None] | None, verdict: str
) -> ConfigResult:
    """One configuration's row: speed (the paired block statistic against full and hf, with its interval),
    predictions, fidelity against full depth's first repetition."""
    m = configs.rt.manifest
    runs = timing.runs
    peer = configs.peers.get(name)
    res = _summary(name, runs[name], timing.rss[name], m.num_layers, peer.spec.runtime if peer is not None else "")
    if name in configs.configs:
        predictions(res, configs.configs[name], m, runs[name], configs.priced.get(name))
    mine, full, strata = timing.array(name), timing.array("full"), timing.strata()
    res.blocks = [[(float(s), int(n), float(w)) for s, n, w in rep] for rep in timing.blocks[name]]
    if name == "full":
        res.speedup_vs_full, res.throughput_vs_full, res.verdict = 1.0, 1.0, "the baseline"
    else:
        # the baseline: full, pooled per block with its A/A copy (two runs next to this one), except for the A/A
        # control itself, which is full's second copy against the first
        base = full if name == AA else full + timing.array(AA)
        res.speedup_vs_full, res.speedup_vs_full_sampling_ci = _paired(base, mine, instances=strata)
        if name == AA:
            res.speedup_vs_full_ci = res.speedup_vs_full_sampling_ci  # the others' are widened (`_readings`)
        res.throughput_vs_full, _ = _paired(base, mine, column=2, instances=strata)
        res.verdict = verdict
    if "hf" in runs and name != "hf":
        res.speedup_vs_hf, _ = _paired(timing.array("hf"), mine, instances=strata)
    gens, ref = runs[name][0].generations, runs["full"][0].generations
    res.token_agreement, res.exact_match, res.first_divergence = agreement(gens, ref)
    res.token_agreement_ci = agreement_ci(gens, ref)
    res.exact_match_ci = wilson(sum(g == f for g, f in zip(gens, ref, strict=True)), len(ref))
    if answers and any(a is not None for a in answers):
        res.gsm8k_accuracy = accuracy(tok, gens, answers[: len(gens)])
    return res


def _heldout_ids(tok: Any, texts: list[str], n: int, max_positions: int) -> list[int]:
    ids: list[int] = []
    for t in texts:
        ids.extend(tok(t, add_special_tokens=False)["input_ids"])
        if len(ids) >= n:
            break
    return ids[: min(n, max_positions - 2)]
