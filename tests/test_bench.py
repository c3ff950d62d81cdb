"""eectl bench on a tiny model: every configuration measured, fidelity numbers consistent, report written."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from eectl.cli import app
from eectl.contracts.plan import Costs
from eectl.data import encode_prompt, final_number, load_text_data
from eectl.evaluate.bench import _heldout_ids, heldout_texts
from eectl.evaluate.predicted import CONDITIONS_BAND, conditions
from eectl.evaluate.stats import agreement as _agreement
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.models import load_model
from eectl.run.generate import RunOptions, load_tokenizer, resolve_config
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from tests.tiny import GSM8K


@pytest.fixture(scope="module")
def artifact(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "art"
    export_artifact(load_model(str(tiny_dirs["llama"])), out, ExportOptions(exits=[2, 4], top_k=8))
    return out


def test_bench_cli_report(artifact, tiny_dirs, tmp_path):
    report = tmp_path / "bench.md"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            str(artifact),
            "--data",
            str(GSM8K),
            "--prompts",
            "3",
            "--max-new-tokens",
            "12",
            "--reps",
            "2",
            "--thresholds",
            "0.0",
            "--sweep",
            "0.5,1.0",
            "--ppl-tokens",
            "64",
            "--raw",
            "--report",
            str(report),
            "--json",
            "--threads",
            "1",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    by = {c["name"]: c for c in doc["configs"]}
    # exact-head: full depth with the full LM head every step, beside the certified head's full depth
    assert list(by) == ["full", "full-aa", "hf", "copy", "defer", "verify", "exact-head"]
    aa = by["full-aa"]  # the A/A control: full depth again, the same tokens, its ratio the run's noise floor
    assert aa["exact_match"] == 1.0 and aa["mean_layers"] == by["full"]["mean_layers"] and aa["decide_share"] == 0.0
    lo, hi = aa["speedup_vs_full_ci"]
    assert lo <= aa["speedup_vs_full"] <= hi  # one statistic: the point estimate sits inside its interval
    assert doc["hf_matches_full"] is True  # transformers generate and eectl full depth: the same tokens
    # every speedup is the median over (repetition, block) of paired ratios measured in this run: the A/A against
    # full, the others against full and full-aa pooled per block (their seconds and tokens summed)
    blocks = {n: np.array(c["blocks"], dtype=float) for n, c in by.items()}
    assert all(b.shape[:2] == (doc["reps_run"], 3) for b in blocks.values())  # batch 1: one block per prompt
    pooled = blocks["full"] + blocks["full-aa"]

    def spt(b):
        return b[..., 0] / b[..., 1]

    assert aa["speedup_vs_full"] == pytest.approx(float(np.median(spt(blocks["full"]) / spt(blocks["full-aa"]))))
    for name, c in by.items():
        if name not in ("full", "full-aa"):
            assert c["speedup_vs_full"] == pytest.approx(float(np.median(spt(pooled) / spt(blocks[name]))))
        if name != "hf":
            assert c["speedup_vs_hf"] == pytest.approx(float(np.median(spt(blocks["hf"]) / spt(blocks[name]))))
    assert by["full"]["speedup_vs_full"] == 1.0 and by["full"]["verdict"] == "the baseline"
    assert doc["verdict"] == "conclusive" or doc["verdict"].startswith("inconclusive: ")
    assert all(c["verdict"] == doc["verdict"] for n, c in by.items() if n != "full")
    lo, hi = aa["speedup_vs_full_ci"]
    assert doc["resolution"] == pytest.approx(max(1 - lo, hi - 1), abs=1e-4)  # the A/A interval's reach from 1
    # the reported interval: the A/A control's own; every other one's widened by the reach, the one its reading uses
    assert aa["speedup_vs_full_ci"] == aa["speedup_vs_full_sampling_ci"]
    reach = doc["resolution"] or 0.0
    for name, c in by.items():
        if name not in ("full", "full-aa"):
            slo, shi = c["speedup_vs_full_sampling_ci"]
            wlo, whi = c["speedup_vs_full_ci"]
            assert (wlo, whi) == pytest.approx((slo - reach, shi + reach))
            if c["reading"]:
                assert (not wlo <= 1.0 <= whi) == (c["reading"] in ("faster", "slower")), name
    assert by["verify"]["token_agreement"] == 1.0 and by["verify"]["exact_match"] == 1.0
    for c in by.values():
        assert c["ms_per_token"] > 0 and c["ms_per_token_spread"][0] <= c["ms_per_token"] <= c["ms_per_token_spread"][1]
    for name in ("copy", "defer"):
        c = by[name]
        assert c["mean_layers"] == 2.0 and c["layer_bound"] == 3.0 and 0 < c["decide_share"] < 1  # threshold 0
        assert c["exit_histogram"] == {"2": sum(c["exit_histogram"].values())}
        assert c["decisions_per_step"] == 1.0 and c["gated"] is False  # every step decides once, at exit 2
        assert c["perplexity"] > 0
    # fidelity against an independent run: the same prompts through the runner, full depth and each policy
    full, early = _independent_runs(artifact, ("copy", "defer"))
    for name, gens in early.items():
        agreement, exact, first = _agreement(gens, full)
        assert by[name]["token_agreement"] == pytest.approx(agreement) and by[name]["exact_match"] == exact
        assert by[name]["first_divergence"] == pytest.approx(first)
        # per token on the policy's own path: transformers' argmax after each prefix of prompt + its tokens
        same, total = _torch_step_agreement(tiny_dirs, artifact, gens)
        assert total > 0 and by[name]["step_agreement"] == pytest.approx(same / total)
        lo, hi = by[name]["step_agreement_ci"]
        assert lo <= by[name]["step_agreement"] <= hi
    assert by["verify"]["step_agreement"] is None and by["full-aa"]["step_agreement"] is None  # cannot differ
    # full-depth perplexity equals transformers' own loss on the same held-out tokens
    assert by["full"]["perplexity"] == pytest.approx(_torch_perplexity(artifact, tiny_dirs, 64), rel=1e-3)
    assert [s["scale"] for s in doc["sweep"]] == [0.5, 1.0]
    assert by["full"]["gsm8k_accuracy"] is not None
    assert report.is_file() and "| full |" in report.read_text()
    assert (tmp_path / "bench-speedup.png").is_file() and (tmp_path / "bench.json").is_file()
    # full depth's decode here against the step the plan was priced with (the manifest's costs)
    costs = Costs.model_validate(json.loads((artifact / "manifest.json").read_text())["costs"])
    cond = doc["conditions"]
    assert cond["here_ms"] == pytest.approx(by["full"]["ms_per_token"], abs=1e-3)
    assert cond["priced_ms"] == pytest.approx(costs.baseline_ms(), abs=1e-3)
    assert cond["ratio"] == pytest.approx(cond["here_ms"] / cond["priced_ms"], rel=1e-2)  # of rounded figures
    assert ("note" in cond) == (abs(cond["ratio"] - 1) > CONDITIONS_BAND)
    assert ("Predictions priced in another state" in report.read_text()) == ("note" in cond)


def _independent_runs(artifact, policies):
    """The bench's first three GSM8K prompts (raw), 12 new tokens: full depth and each policy at threshold 0."""
    rt = ArtifactRuntime(artifact, provider="cpu")
    tok = load_tokenizer(rt)
    ids = [encode_prompt(tok, p, raw=True) for p in load_text_data(str(GSM8K)).prompts[:3]]
    stop = tuple(rt.manifest.eos_token_ids)

    def gens(opts: RunOptions) -> list[list[int]]:
        runner = Runner(rt, resolve_config(rt, opts, stop))
        return [runner.generate([p])[0].token_ids for p in ids]

    full = gens(RunOptions(exits="none", max_new_tokens=12))
    return full, {p: gens(RunOptions(policy=p, thresholds="0.0", max_new_tokens=12)) for p in policies}


def _torch_step_agreement(tiny_dirs, artifact, gens):
    """(tokens transformers' full depth also chooses after the same prefix, tokens) over the bench's three prompts:
    one causal pass over prompt + generated tokens, the argmax at each position before a generated token."""
    rt = ArtifactRuntime(artifact, provider="cpu")
    tok = load_tokenizer(rt)
    ids = [encode_prompt(tok, p, raw=True) for p in load_text_data(str(GSM8K)).prompts[:3]]
    model = load_model(str(tiny_dirs["llama"])).model
    same = total = 0
    with torch.no_grad():
        for prompt, gen in zip(ids, gens, strict=True):
            logits = model(torch.tensor([prompt + gen])).logits[0]
            want = logits[len(prompt) - 1 : len(prompt) - 1 + len(gen)].argmax(-1).tolist()
            same += sum(a == b for a, b in zip(gen, want, strict=True))
            total += len(gen)
    return same, total


def _torch_perplexity(artifact, tiny_dirs, n):
    rt = ArtifactRuntime(artifact, provider="cpu")
    texts = load_text_data(str(GSM8K)).texts
    ids = _heldout_ids(load_tokenizer(rt), heldout_texts(texts), n, rt.manifest.max_positions)
    model = load_model(str(tiny_dirs["llama"])).model
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return math.exp(float(torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]))))


def test_bench_batch_size_reports_throughput_and_keeps_each_rows_tokens(artifact):
    """--batch-size 2 over 3 prompts (a batch of 2, then 1): throughput beside per-row latency, and every row's
    tokens equal its independent run alone (full depth and defer)."""
    args = ["bench", str(artifact), "--data", str(GSM8K), "--prompts", "3", "--max-new-tokens", "12", "--reps", "1"]
    args += ["--policies", "full,defer", "--thresholds", "0.0", "--sweep", "", "--ppl-tokens", "0", "--raw"]
    res = CliRunner().invoke(app, [*args, "--batch-size", "2", "--json", "--threads", "1"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    by = {c["name"]: c for c in doc["configs"]}
    assert doc["batch_size"] == 2
    # throughput against full: the paired block statistic on wall time per decoded token of all the batch's rows
    blocks = {n: np.array(c["blocks"], dtype=float) for n, c in by.items()}
    assert blocks["full"].shape[:2] == (doc["reps_run"], 2)  # two blocks: a batch of 2, then 1
    pooled = blocks["full"] + blocks["full-aa"]
    for name, c in by.items():
        assert c["throughput"] > 0
        if name not in ("full", "full-aa"):
            want = np.median((pooled[..., 2] / pooled[..., 1]) / (blocks[name][..., 2] / blocks[name][..., 1]))
            assert c["throughput_vs_full"] == pytest.approx(float(want))
    full, early = _independent_runs(artifact, ("defer",))
    agreement, exact, first = _agreement(early["defer"], full)
    assert by["defer"]["token_agreement"] == pytest.approx(agreement) and by["defer"]["exact_match"] == exact
    assert by["full"]["exact_match"] == 1.0


def test_bench_rejects_unknown_config(artifact):
    res = CliRunner().invoke(app, ["bench", str(artifact), "--policies", "full,turbo", "--data", str(GSM8K)])
    assert res.exit_code == 2 and "unknown configuration" in res.stderr


def test_agreement_and_answers():
    assert _agreement([[1, 2, 3], [4, 5]], [[1, 2, 4], [4, 5]]) == (pytest.approx(4 / 5), 0.5, 2.0)
    assert final_number("so 3 + 4 = 7.\n#### 1,200") == "1200" and final_number("none") is None


def test_an_aa_pair_of_runtimes_takes_turns_step_by_step_with_each_ones_own_tokens(artifact):
    """`--compare twin=<the same artifact>`: a second runtime of the artifact in the process (an A/A pair of
    runtimes). The timed phase steps full, the twin and copy in turn, one decode step each (timing._turns), so
    whatever differs over time falls on both runtimes alike; each keeps its own cache: the tokens equal each
    configuration generated alone."""
    from eectl.evaluate import timing
    from eectl.evaluate.configs import Configs
    from eectl.evaluate.results import BenchOptions

    rt = ArtifactRuntime(artifact, provider="cpu")
    opts = BenchOptions(
        configs=["full", "copy"], compare={"twin": str(artifact)}, thresholds="0.0", max_new_tokens=12, provider="cpu"
    )
    configs = Configs(rt, opts, tuple(rt.manifest.eos_token_ids))
    assert configs.runners["twin"].rt is not rt and all(configs.steps(n) for n in ("full", "twin", "copy"))
    tok = load_tokenizer(rt)
    ids = [encode_prompt(tok, p, raw=True) for p in load_text_data(str(GSM8K)).prompts[:2]]
    stepped: list[str] = []
    real_once = configs.once

    def once(name, block, on_step=None, instance=0):
        def step(i, confirmed):
            stepped.append(name)
            on_step(i, confirmed)

        return real_once(name, block, on_step=step if on_step is not None else None, instance=instance)

    configs.once = once  # type: ignore[method-assign]
    for p in ids:
        stepped.clear()
        done = timing._turns(configs, ["full", "twin", "copy"], [p])
        n = len(done["full"].generations[0])
        assert n == 12 and stepped[:6] == ["full", "twin", "copy"] * 2  # one step each, in turn
        assert stepped.count("twin") == n  # one step per token (the prefill gives the first)
        for name in ("full", "twin", "copy"):
            alone = configs.runners[name].generate([p])[0].token_ids
            assert done[name].generations == [alone], name
        assert done["twin"].generations == done["full"].generations


def test_an_aa_pair_of_runtimes_is_created_mirrored_and_every_configuration_alternates_instances(artifact):
    """`--compare same=<the same artifact>`: runtimes are created in the mirrored order (this artifact, same, same,
    this artifact), each instance's configurations on their own runtimes; in the timed phase every configuration of
    a block runs on the same instance, alternating block by block (and by repetition, so each prompt runs on both);
    tokens do not depend on the instance. run_bench records the instances and its notes say what was done."""
    from eectl.evaluate import timing
    from eectl.evaluate.bench import COMPARE_NOTE, _notes, bench_units, run_bench
    from eectl.evaluate.configs import Configs
    from eectl.evaluate.results import AA, BenchOptions

    rt = ArtifactRuntime(artifact, provider="cpu")
    opts = BenchOptions(
        configs=["full", "copy"], compare={"same": str(artifact)}, thresholds="0.0", max_new_tokens=8, provider="cpu"
    )
    configs = Configs(rt, opts, tuple(rt.manifest.eos_token_ids))
    assert configs.created == [("full", 0), ("same", 0), ("same", 1), ("full", 1)] and configs.instances == 2
    main = [configs.sets[i]["full"].rt for i in range(2)]
    same = [configs.sets[i]["same"].rt for i in range(2)]
    assert main[0] is rt and len({id(x) for x in main + same}) == 4  # four runtimes
    for i in range(2):
        assert all(configs.sets[i][n].rt is main[i] for n in ("full", AA, "copy"))
    ran: list[tuple[str, int]] = []
    real_once = configs.once

    def once(name, block, on_step=None, instance=0):
        ran.append((name, instance))
        return real_once(name, block, on_step=on_step, instance=instance)

    configs.once = once  # type: ignore[method-assign]
    tok = load_tokenizer(rt)
    ids = [encode_prompt(tok, p, raw=True) for p in load_text_data(str(GSM8K)).prompts[:3]]
    order = ["full", AA, "copy", "same"]
    t = timing._timed(configs, order, ids, range(2), None)
    assert sorted(ran[:8]) == sorted((n, i) for n in order for i in range(2))  # the warm-up: both instances
    assert t.instances == [[0, 1, 0], [1, 0, 1]]
    blocks = [ran[8 + 4 * k : 12 + 4 * k] for k in range(6)]
    assert [{i for _, i in blk} for blk in blocks] == [{i} for rep in t.instances for i in rep]
    assert all(sorted(n for n, _ in blk) == sorted(order) for blk in blocks)
    for r in range(2):  # each prompt ran on instance 0 in one repetition and on 1 in the other: the same tokens
        assert all(t.runs[n][r].generations == t.runs["full"][r].generations for n in (AA, "same"))
        assert t.runs["copy"][r].generations == t.runs["copy"][0].generations
    assert t.runs["full"][1].generations == t.runs["full"][0].generations
    assert COMPARE_NOTE in _notes(rt, opts) and COMPARE_NOTE not in _notes(rt, BenchOptions(configs=["full"]))

    bench_opts = BenchOptions(
        configs=["full", "same"], compare={"same": str(artifact)}, prompts=3, max_new_tokens=6, reps=2, ppl_tokens=0,
        sweep=[], provider="cpu", raw=True,
    )  # fmt: skip
    ticks: list[int] = []
    res = run_bench(artifact, load_text_data(str(GSM8K)).prompts, bench_opts, progress=ticks.append)
    assert sum(ticks) == bench_units(bench_opts, 3)  # the warm-up on both instances counted
    assert res.block_instances == [[(r + b) % 2 for b in range(3)] for r in range(res.reps_run)]
    by = {c.name: c for c in res.configs}
    assert by["same"].exact_match == 1.0 and COMPARE_NOTE in res.notes


def test_configurations_that_run_full_depth_are_not_timed_again(artifact, monkeypatch):
    """A configuration that runs exactly what full depth runs (no active exit, no drafts: here copy and verify with
    --exits none) is not timed beside full depth: its row is full depth's figures under its name, marked
    `timed_as` full, in the asked order; a configuration with exits is timed as ever, and progress still adds up."""
    from eectl.evaluate.bench import bench_units, run_bench
    from eectl.evaluate.configs import Configs
    from eectl.evaluate.results import AA, BenchOptions

    ran: list[str] = []
    real = Configs.once

    def once(self, name, *a, **k):
        ran.append(name)
        return real(self, name, *a, **k)

    monkeypatch.setattr(Configs, "once", once)
    opts = BenchOptions(
        configs=["full", "copy", "verify"], exits="none", prompts=2, max_new_tokens=6, reps=1, ppl_tokens=32,
        sweep=[], provider="cpu", raw=True,
    )  # fmt: skip
    ticks: list[int] = []
    res = run_bench(artifact, load_text_data(str(GSM8K)).prompts, opts, heldout=["a held out text"] * 4,
                    progress=ticks.append)  # fmt: skip
    assert sum(ticks) == bench_units(opts, 2)
    assert set(ran) == {"full", AA, "exact-head"}  # copy and verify were never run (exact-head is not full depth's run)
    by = {c.name: c for c in res.configs}
    assert [c.name for c in res.configs] == ["full", AA, "copy", "verify", "exact-head"]
    for name in ("copy", "verify"):
        c = by[name]
        assert c.timed_as == "full" and c.speedup_vs_full == 1.0 and c.exits == [] and not c.blocks
        assert c.ms_per_token == by["full"].ms_per_token and c.perplexity == by["full"].perplexity
        assert "not timed apart" in c.reading
    assert by["full"].timed_as == by[AA].timed_as == ""
    ran.clear()
    timed = run_bench(artifact, load_text_data(str(GSM8K)).prompts, replace(opts, exits="2", thresholds="0.0"))
    assert {"copy", "verify"} <= set(ran) and all(c.timed_as == "" for c in timed.configs)


def test_conditions_say_when_full_depth_decodes_away_from_the_step_the_plan_was_priced_with(artifact):
    """A bench's full depth against `Costs.baseline_ms` (one row): a note beyond CONDITIONS_BAND either way, none
    inside it; nothing without costs or at a batch size above one (the costs are one row's)."""
    costs = Costs.model_validate(json.loads((artifact / "manifest.json").read_text())["costs"])
    priced = costs.baseline_ms()
    PAST = ([[1] * 100, [1] * 120], [[2] * 40, [2] * 40])  # prompts of 110 tokens on average, answers of 40
    inside = conditions(costs, priced * (1 + CONDITIONS_BAND * 0.9), *PAST, 1)
    assert inside is not None and "note" not in inside and inside["ratio"] == pytest.approx(1 + CONDITIONS_BAND * 0.9)
    slower = conditions(costs, priced * 1.5, *PAST, 1)
    faster = conditions(costs, priced / 1.5, *PAST, 1)
    assert slower is not None and "1.50x: slower" in slower["note"] and "--profile-costs" in slower["note"]
    assert faster is not None and "0.67x: faster" in faster["note"]
    assert conditions(None, priced, *PAST, 1) is None and conditions(costs, priced * 1.5, *PAST, 4) is None
