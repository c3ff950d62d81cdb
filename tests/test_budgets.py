"""Training budgets (contracts/budgets.py, recipe.apply_budget), the data check before a state cache
(heads/supply.py) and the pipeline's verdict (pipeline/verdict.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eectl.cli import app
from eectl.contracts.budgets import BUDGETS, HELD_TOKENS, TWIN_REVISION, states_folder
from eectl.contracts.recipe import Recipe, apply_budget, load_recipe
from eectl.data import TextData
from eectl.errors import DataError, UsageError
from tests.tiny import GSM8K


def _recipe(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def test_a_command_budget_sets_every_size_over_the_recipe(tmp_path):
    path = _recipe(tmp_path, "name: r\ndata: {tokens: 123}\nheads: {tokens: 77}\nbench: {prompts: 3}\n")
    plain = load_recipe(path)
    assert plain.budget is None and plain.heads.cache is None and plain.data.tokens == 123  # no budget: as written
    std = BUDGETS["standard"]
    r = load_recipe(path, "standard")
    assert r.budget == "standard"
    assert r.data.tokens == std.calibrate_tokens and r.profile.tokens == std.profile_tokens
    assert (r.heads.tokens, r.heads.probe_tokens, r.heads.batch_tokens) == (
        std.cache_tokens,
        std.probe_tokens,
        std.batch_tokens,
    )
    assert r.heads.eval_tokens == HELD_TOKENS and r.heads.loss == "topk"
    assert (r.bench.prompts, r.bench.max_new_tokens, r.bench.reps) == (
        std.bench_prompts,
        std.bench_tokens,
        std.bench_reps,
    )
    assert r.heads.cache == states_folder("r", r.data.source)  # a budget trains from a state cache
    assert r.export.cost_seconds == std.cost_seconds and BUDGETS["quick"].cost_seconds < std.cost_seconds


def test_a_recipe_budget_keeps_the_sizes_the_recipe_writes(tmp_path):
    path = _recipe(tmp_path, "name: r\nbudget: quick\nheads: {tokens: 512, cache: my-states}\n")
    r = load_recipe(path)
    q = BUDGETS["quick"]
    assert r.heads.tokens == 512 and r.heads.cache == "my-states"  # written: kept
    assert r.heads.probe_tokens == q.probe_tokens and r.data.tokens == q.calibrate_tokens  # not written: the budget's
    assert load_recipe(path, "thorough").heads.tokens == BUDGETS["thorough"].cache_tokens  # --budget wins


def test_unknown_budgets_are_one_line_errors(tmp_path):
    with pytest.raises(UsageError, match="unknown budget 'huge'"):
        load_recipe(None, "huge")
    with pytest.raises(UsageError, match="budget: .*unknown budget 'huge'"):
        load_recipe(_recipe(tmp_path, "name: r\nbudget: huge\n"))
    res = CliRunner().invoke(app, ["bench", "x", "--budget", "huge"])
    assert res.exit_code == 2 and "unknown budget 'huge'" in res.output


def test_budgets_grow_and_share_the_held_out_split():
    names = list(BUDGETS)
    assert names == ["quick", "standard", "thorough"]
    for small, large in zip(names, names[1:], strict=False):
        a, b = BUDGETS[small], BUDGETS[large]
        assert b.cache_tokens > a.cache_tokens and b.calibrate_tokens > a.calibrate_tokens
        assert b.prompts_needed() > a.prompts_needed()
    # every budget holds out the same records, so a larger one extends a smaller one's cache
    assert {apply_budget(Recipe(name="r"), n).heads.eval_tokens for n in names} == {HELD_TOKENS}


def test_the_state_cache_folder_follows_the_data():
    assert states_folder("r", "humaneval") != states_folder("r", "a/train.jsonl")
    assert states_folder("r", "humaneval") == states_folder("r", "humaneval")
    # the int4 twin's states are another model's, and a new twin revision's another again (nothing reused across)
    assert states_folder("r", "humaneval", "int4").endswith(f"-int4-twin{TWIN_REVISION}")


class _WordTokenizer:
    eos_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [5] * len(text.split())}


def _data(n: int, words: int) -> TextData:
    texts = [" ".join(["w"] * words) for _ in range(n)]
    return TextData("mine.jsonl", "", texts, texts)


def test_data_too_small_for_a_budget_is_refused_with_what_it_needs():
    from eectl.heads.supply import cache_supply, check_supply

    r = apply_budget(Recipe(name="r"), "quick")
    need = BUDGETS["quick"].prompts_needed()
    s = cache_supply(_WordTokenizer(), _data(1000, 200), r)
    assert s.enough and s.prompts_needed == need  # the budget's own count and the recipe's agree
    with pytest.raises(DataError, match=rf"budget quick needs at least {need} prompts .* mine.jsonl has 10 prompts"):
        check_supply(_WordTokenizer(), _data(10, 2000), r)
    with pytest.raises(DataError, match="tokens of text"):  # prompts enough, text too short
        check_supply(_WordTokenizer(), _data(need, 3), r)


def test_pipeline_refuses_data_too_small_before_any_stage(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EECTL_CACHE", str(tmp_path / "cache"))
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"question": f"q{i} a b", "answer": "c d"}) + "\n" for i in range(12)))
    recipe = _recipe(tmp_path, f"name: tiny\nmodel: {tiny_dirs['llama']}\nexits: [3]\nthreads: 1\n")
    res = CliRunner().invoke(app, ["pipeline", "--recipe", str(recipe), "--budget", "quick", "--data", str(small)])
    assert res.exit_code == 4, res.output
    assert "needs at least" in res.output and "has 12 prompts" in res.output
    made = tmp_path / "artifacts"
    assert not made.exists() or not any(made.iterdir())  # no stage ran: nothing written


def test_pipeline_under_a_budget_trains_from_a_state_cache_and_ends_on_a_verdict(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EECTL_CACHE", str(tmp_path / "cache"))
    recipe = _recipe(
        tmp_path,
        f"""name: tiny
model: {tiny_dirs["llama"]}
budget: quick
exits: [3]
target: 0.9
top_k: 8
threads: 1
data: {{source: {GSM8K}, tokens: 400}}
profile: {{tokens: 256}}
heads: {{tokens: 512, probe_tokens: 512}}
bench: {{prompts: 2, max_new_tokens: 3, reps: 1, configs: [full], ppl_tokens: 0, sweep: []}}
""",
    )
    res = CliRunner().invoke(app, ["pipeline", "--recipe", str(recipe), "--prompt", "12 clips"])
    assert res.exit_code == 0, res.output
    states = tmp_path / states_folder("tiny", str(GSM8K))
    cache = json.loads((states / "cache.json").read_text())
    assert cache["complete"] and cache["budgets"]["gen_tokens"] == 128  # 25% of 512: the model's own continuations
    name = tiny_dirs["llama"].name
    meta = json.loads((tmp_path / "artifacts" / f"{name}-heads.json").read_text())
    assert meta["probe"] is not None  # the learned signal's probes, fitted from the cache
    out = res.stdout
    assert "buys: " in out and "budget quick: " in out and "budget standard: about " in out
    assert json.loads((tmp_path / "artifacts" / f"{name}-bench.json").read_text())["prompts"] == 2


def test_the_pipelines_bench_measures_the_datas_last_prompts():
    """Held out of the state cache (its last records) and after calibration's (it reads the data from the start)."""
    from eectl.data import load_text_data
    from eectl.pipeline.runner import bench_offset

    r = apply_budget(Recipe(name="r", data={"source": str(GSM8K)}), "quick")
    n = len(load_text_data(str(GSM8K)).prompts)
    assert bench_offset(r) == n - r.bench.prompts
    tiny = r.model_copy(update={"bench": r.bench.model_copy(update={"prompts": n + 5})})
    assert bench_offset(tiny) == 0  # fewer prompts than asked: all of them


def _bench_doc(verdict: str, speed: float = 1.2) -> dict:
    return {
        "verdict": verdict,
        "default": "verify",
        "prompts": 5,
        "resolution": 0.012,
        "configs": [
            {"name": "full", "speedup_vs_full": 1.0},
            {
                "name": "verify",
                "speedup_vs_full": speed,
                "speedup_vs_full_ci": [1.1, 1.3],
                "token_agreement": 1.0,
                "reading": "faster",
            },
        ],
    }


def test_the_verdict_claims_a_speedup_only_from_a_conclusive_bench():
    from eectl.pipeline.verdict import _buys

    line = _buys(_bench_doc("conclusive"))
    assert line.startswith("buys: the default (verify) 1.20x [1.10, 1.30]") and "identical to full depth" in line
    doubtful = _buys(_bench_doc("inconclusive: A/A 1.06x outside [0.97, 1.03]"))
    assert doubtful.startswith("buys: no claim") and "1.20" not in doubtful
    lossy = _bench_doc("conclusive")
    lossy["default"] = "certified"
    lossy["configs"][1].update(name="certified", token_agreement=0.93)
    assert "token agreement 93.0%" in _buys(lossy)


def test_the_verdict_says_when_the_bench_ran_in_another_state_than_the_plans_pricing():
    from eectl.pipeline.verdict import _conditions

    doc = _bench_doc("conclusive")
    assert _conditions(doc) == []  # a bench without the reading (older reports) or inside the band: no line
    doc["conditions"] = {"priced_ms": 9.0, "here_ms": 9.5, "ratio": 1.056}
    assert _conditions(doc) == []
    doc["conditions"] = {"priced_ms": 12.9, "here_ms": 8.2, "ratio": 0.636, "note": "full depth decoded at 8.2 ms"}
    assert _conditions(doc) == ["conditions: full depth decoded at 8.2 ms"]


def test_the_next_budget_time_scales_this_runs_stages():
    from eectl.pipeline.runner import StageRun
    from eectl.pipeline.verdict import _budget_lines

    stages = [StageRun("profile", 10.0, "ran"), StageRun("export", 5.0, "ran"), StageRun("train-heads", 20.0, "ran")]
    r = apply_budget(Recipe(name="r"), "quick")
    q, s = BUDGETS["quick"], BUDGETS["standard"]
    want = (
        10.0 * s.profile_tokens / q.profile_tokens
        + 5.0
        + 20.0 * (s.cache_tokens + s.probe_tokens) / (q.cache_tokens + q.probe_tokens)
    )
    lines = _budget_lines(r, stages)
    assert lines[0].startswith("budget quick: 0.6 min here")
    assert f"about {want / 60:.0f} min" in lines[1]
    cached = [*stages[:2], StageRun("train-heads", 0.1, "cached: heads")]
    assert "not estimated" in _budget_lines(r, cached)[1]
    assert _budget_lines(apply_budget(Recipe(name="r"), "thorough"), stages)[1:] == []  # no larger budget


def test_the_needs_line_is_the_cost_models_break_even():
    from eectl.pipeline.verdict import _needs
    from eectl.plan.choose import predict
    from tests.test_plan import _costs  # segments end at 4, 8, 12; exits at 4 and 8

    costs = _costs()
    manifest = {
        "costs": costs.model_dump(),
        "plan": {"min_gain": 0.03, "default": "full"},
        "segments": [{"layers": [0, 4]}, {"layers": [4, 8]}, {"layers": [8, 12]}],
    }
    option = {"exits": [4], "target": 0.99, "per_exit": [{"coverage": 0.1, "precision": 0.995}]}
    loose = {"exits": [4], "target": 0.9, "per_exit": [{"coverage": 0.4, "precision": 0.9}]}  # below the bar
    line = _needs(manifest, {"target": 0.99, "options": [option, loose]})
    share = int(line.split("once ")[1].split("%")[0]) / 100
    layer = int(line.split("exit ")[1].split(" ")[0])
    assert predict(costs, [4, 8, 12], "verify", [(layer, share, 0.99)]).speedup >= 1.03  # pays at the share named
    assert predict(costs, [4, 8, 12], "verify", [(layer, share - 0.01, 0.99)]).speedup < 1.03  # and not below it
    assert layer == 4 and line.endswith("these heads reach 10% (calibration's menu)")
    # an exit no held-out token passed (precision null in the file) reaches nothing; it does not break the line
    never = {"exits": [4], "target": 0.999, "per_exit": [{"coverage": 0.0, "precision": None}]}
    assert _needs(manifest, {"target": 0.99, "options": [never, option]}) == line
    assert _needs(manifest, {"target": 0.99, "options": [never]}).endswith("these heads reach 0% (calibration's menu)")
    manifest["plan"]["default"] = "verify"  # exits run already: no bar to state
    assert _needs(manifest, {"target": 0.99, "options": [option, loose]}) == ""


def test_the_next_budget_time_scales_only_the_sized_phases():
    """A stage that reports phases: each sized phase scaled by its size, the fixed ones and the stage's unaccounted
    time kept; the old whole-stage scaling is not it."""
    from eectl.phases import Phases
    from eectl.pipeline.runner import StageRun
    from eectl.pipeline.verdict import _budget_lines, _estimate

    q, s = BUDGETS["quick"], BUDGETS["standard"]
    heads = Phases()
    heads.add("load data and model", 20.0)
    heads.add("state cache: train text", 10.0, "text_tokens")
    heads.add("state cache: train continuations", 6.0, "gen_steps")
    heads.add("state cache: held-out text", 4.0)
    heads.add("train heads", 6.0, "train_steps")
    heads.add("probes", 2.0, "probe_tokens")
    stage = StageRun("train-heads", 50.0, "ran", phases=heads)  # 2 s outside every phase
    grown = {
        "text": 10.0 * s.text_tokens / q.text_tokens,
        "continuations": 6.0 * 512 / 64,  # decode steps: 8 batches of 64 continuations against quick's one (of 25)
        "train": 6.0 * (s.cache_tokens // 64) / (q.cache_tokens // 32),  # optimiser steps
        "probes": 2.0 * s.probe_tokens / q.probe_tokens,
    }
    want = 20.0 + 4.0 + 2.0 + sum(grown.values())
    assert _estimate(stage, q, s) == pytest.approx(want)
    whole = 50.0 * (s.cache_tokens + s.probe_tokens) / (q.cache_tokens + q.probe_tokens)  # the old formula
    assert _estimate(stage, q, s) < 0.75 * whole

    profile = Phases()
    profile.add("logit lens", 8.0, "profile_tokens")
    stages = [StageRun("profile", 10.0, "ran", phases=profile), StageRun("export", 5.0, "ran"), stage]
    lines = _budget_lines(apply_budget(Recipe(name="r"), "quick"), stages)
    total = 2.0 + 8.0 * s.profile_tokens / q.profile_tokens + 5.0 + want
    assert f"about {total / 60:.0f} min" in lines[1] and "an estimate from this run's phases" in lines[1]


def test_a_stage_without_phases_is_scaled_whole_and_a_reused_state_cache_is_not_estimated():
    from eectl.phases import Phases
    from eectl.pipeline.runner import StageRun
    from eectl.pipeline.verdict import _budget_lines, _estimate

    q, s = BUDGETS["quick"], BUDGETS["standard"]
    bare = StageRun("calibrate", 30.0, "ran", result=object())  # a result without phases
    assert bare.phases is None
    assert _estimate(bare, q, s) == pytest.approx(30.0 * s.calibrate_tokens / q.calibrate_tokens)
    assert _estimate(StageRun("run", 3.0, "ran"), q, s) == 3.0  # a stage no size names
    split = Phases()
    split.add("logit lens", 8.0, "profile_tokens")
    r = apply_budget(Recipe(name="r"), "quick")
    line = _budget_lines(r, [StageRun("profile", 10.0, "ran", phases=split), bare])[1]
    assert "an estimate from this run's phases" in line and "calibrate scaled whole" in line

    class Result:  # a stage function's result: the pipeline carries its phases
        phases = Phases(reused="the state cache was there")

    reused = StageRun("train-heads", 12.0, "ran", result=Result())
    assert reused.phases is Result.phases
    line = _budget_lines(r, [bare, reused])[1]
    assert "not estimated: train-heads: the state cache was there" in line and "about" not in line


def test_phases_add_up_and_keep_their_size():
    from eectl.phases import FIXED, Phases

    p = Phases()
    with p.time("load"):
        pass
    p.add("train", 2.0, "train_steps")
    p.add("train", 1.5, "train_steps")
    assert p.phases["train"].seconds == 3.5 and p.phases["train"].size == "train_steps"
    assert p.phases["load"].size == FIXED and p.seconds == pytest.approx(3.5 + p.phases["load"].seconds)
    assert p.describe().startswith("load 0.0 s (fixed), train 3.5 s (train_steps)")


def test_every_size_a_phase_names_is_a_budget_size():
    from eectl.contracts.budgets import SIZES

    for b in BUDGETS.values():
        assert all(size(b) > 0 for size in SIZES.values())


def test_calibrate_continuations_scale_with_their_decode_steps():
    """Calibrate's continuations (a quarter of its tokens, 64 prompts a batch, 64 tokens each) cost per decode step:
    quick's 1,500 generated tokens take one batch (64 steps), standard's 5,000 two (128), not 20000/6000 = 3.3x."""
    from eectl.calibrate.calibrator import CalibrateOptions
    from eectl.contracts.budgets import CALIBRATE_GEN_SHARE, SIZES

    assert CalibrateOptions(exits=[]).gen_share == CALIBRATE_GEN_SHARE  # the size reads calibrate's default
    q, s = BUDGETS["quick"], BUDGETS["standard"]
    assert SIZES["calibrate_gen_steps"](q) == 64 and SIZES["calibrate_gen_steps"](s) == 128


def test_the_readme_and_the_default_recipe_give_the_budgets_sizes():
    """The README's budgets table (state cache, calibration, bench) and the default recipe's comment on the quick
    budget (profile, state cache, calibration, bench, re-timing) give the sizes BUDGETS holds: issue 63 cut quick's
    profile and re-timing to keep the main job under 6 minutes, and a stale line would promise a newcomer other
    sizes."""
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8").splitlines()
    for b in BUDGETS.values():
        row = next(line for line in readme if line.startswith(f"| `{b.name}` |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1:4] == [
            f"{b.cache_tokens:,}",
            f"{b.calibrate_tokens:,}",
            f"{b.bench_prompts} x {b.bench_tokens} x {b.bench_reps}",
        ], b.name
    recipe = (root / "recipes" / "smollm2-135m-instruct.yaml").read_text(encoding="utf-8")
    quick = " ".join(recipe[recipe.index("#   quick") : recipe.index("#   standard")].replace("#", " ").split())
    q = BUDGETS["quick"]
    for words in (
        f"profile {q.profile_tokens:,} tokens",
        f"state cache {q.cache_tokens:,} tokens",
        f"calibrate {q.calibrate_tokens:,} tokens",
        f"bench {q.bench_prompts} prompts x {q.bench_tokens} tokens x {q.bench_reps} reps",
        f"up to {q.cost_seconds:.0f} s",
    ):
        assert words in quick, words


def test_the_readmes_budget_table_says_the_prompts_each_budget_needs():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    rows = {
        m[1]: int(m[2].replace(",", ""))
        for m in re.finditer(r"^\| `(\w+)` \|[^|]*\|[^|]*\|[^|]*\| ([\d,]+) \|", readme, re.M)
    }
    assert rows == {name: b.prompts_needed() for name, b in BUDGETS.items()}


def test_the_verdict_sets_the_default_and_full_depth_against_llama_cpp_where_the_bench_ran_it():
    from eectl.pipeline.verdict import _peer_lines

    bench = {
        "default": "lookup",
        "configs": [
            {"name": "full", "ms_per_token": 10.0},
            {"name": "lookup", "ms_per_token": 5.0},
            {"name": "llama.cpp", "ms_per_token": 9.0},
        ],
    }
    (line,) = _peer_lines(bench)
    assert "the default (lookup) 1.80x its speed, full depth 0.90x (9.0 ms a token there" in line
    assert "divergence" not in line  # no fp32 reference ran: no fidelity clause
    bench["fp32_reference"] = "hf"
    bench["configs"][1]["fp32_first_divergence"], bench["configs"][2]["fp32_first_divergence"] = 38.25, 34.125
    (line,) = _peer_lines(bench)
    assert line.endswith(
        "fp32 model's tokens (hf): the default at token 38.2, llama.cpp at 34.1 (mean over the prompts)"
    )
    bench["configs"] = bench["configs"][:2]
    assert _peer_lines(bench) == []  # no peer ran: no line
