"""`weights: int4` in a recipe: train-heads and calibrate fit against the int4 twin (models/int4.py), the
pipeline exports int4 segments with the same settings, and the pipeline's reuse keys tell the two apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eectl.contracts.recipe import Int4Spec, Recipe, load_recipe
from eectl.models import load_model
from eectl.output import Output


class _Stop(Exception):
    pass


def test_load_model_with_int4_settings_is_the_twin(tiny_dirs):
    from eectl.models.int4 import to_int4_twin

    fp32 = load_model(str(tiny_dirs["llama"]))
    twin = load_model(str(tiny_dirs["llama"]), int4=Int4Spec())
    want = to_int4_twin(load_model(str(tiny_dirs["llama"])), Int4Spec())
    a, b, c = (m.adapter.layers[1].mlp.down_proj.weight for m in (fp32, twin, want))
    assert torch.equal(b, c) and not torch.equal(a, b)  # ORT's int4 values, not the checkpoint's


def test_the_recipe_int4_settings_reach_the_torch_stages(tiny_dirs, tmp_path, monkeypatch):
    from eectl.calibrate.stage import CalibrateRequest, calibrate
    from eectl.heads.stage import HeadsRequest, train_heads

    seen: list[object] = []

    def spy(spec, *a, int4=None, **k):
        seen.append(int4)
        raise _Stop

    monkeypatch.setattr("eectl.models.load_model", spy)
    path = tmp_path / "r.yaml"
    path.write_text(f"name: r\nmodel: {tiny_dirs['llama']}\nweights: int4\nint4: {{block_size: 16}}\n")
    r = load_recipe(path)
    assert r.int4_twin() == Int4Spec(block_size=16)
    with pytest.raises(_Stop):
        train_heads(r, HeadsRequest(out=tmp_path / "h.safetensors", steps=1, device="cpu"), Output(quiet=True))
    with pytest.raises(_Stop):
        calibrate(r, CalibrateRequest(out=tmp_path / "c.json", device="cpu"), Output(quiet=True))
    assert seen == [Int4Spec(block_size=16)] * 2
    assert Recipe(name="x").int4_twin() is None  # fp32 by default: the checkpoint's own model


def test_the_pipeline_exports_the_recipes_weights_and_keys_them(tiny_dirs, tmp_path, monkeypatch):
    from eectl.pipeline.cache import PipelineCache
    from eectl.pipeline.runner import _Stages
    from eectl.pipeline.steps import plan

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EECTL_CACHE", str(tmp_path / "cache"))
    got: list[object] = []

    def spy(recipe, req, out):
        got.append(req.options)
        raise _Stop

    monkeypatch.setattr("eectl.export.stage.export", spy)
    spec = Int4Spec(block_size=64, keep_layers=[0], exact_wide=True)
    r = Recipe(name="r", model=str(tiny_dirs["llama"]), weights="int4", int4=spec)
    r = r.model_copy(update={"export": r.export.model_copy(update={"cost_seconds": 7.5})})
    p = plan(r, Path("artifacts"))
    stages = _Stages(r, Path("r.yaml"), p, "hi", False, 1, Output(quiet=True), None)  # type: ignore[arg-type]
    with pytest.raises(_Stop):
        stages.run("export")
    options = got[0]
    assert options.weights == "int4" and options.int4.block_size == 64 and options.int4.keep_layers == (0,)
    assert options.cost_seconds == 7.5  # the budget's (or recipe's) re-timing time reaches export
    assert options.exact_wide  # the recipe's int4: {exact_wide: true}
    fp32 = r.model_copy(update={"weights": "fp32"})
    assert PipelineCache(r, p).key("train-heads") != PipelineCache(fp32, p).key("train-heads")
    # an fp32 run of the same model keeps its outputs: every path the int4 run writes is its own
    q = plan(fp32, Path("artifacts"))
    mine = (p.artifact, p.report, p.profile_plot, p.heads, p.calibration)
    theirs = (q.artifact, q.report, q.profile_plot, q.heads, q.calibration)
    assert q.artifact.name == tiny_dirs["llama"].name and p.artifact.name == f"{q.artifact.name}-int4"
    assert not set(mine) & set(theirs)


def test_the_twins_state_cache_is_its_own(tiny_dirs, tmp_path):
    """States of the int4 twin are not the checkpoint's: a budget's default cache folder and the cache's identity
    both tell them apart, so an fp32 cache is never reused for the twin."""
    from eectl.contracts.budgets import states_folder
    from eectl.contracts.recipe import apply_budget
    from eectl.data import load_text_data
    from eectl.heads.state_cache import CacheSpec
    from eectl.heads.state_cache_build import _identity

    fp32 = apply_budget(Recipe(name="r"), "quick")
    int4 = apply_budget(Recipe(name="r", weights="int4"), "quick")
    assert fp32.heads.cache == states_folder("r", "humaneval") != int4.heads.cache
    data = load_text_data("humaneval")
    spec = CacheSpec(layers=[3])
    a = _identity(load_model(str(tiny_dirs["llama"])), data, spec)
    b = _identity(load_model(str(tiny_dirs["llama"]), int4=Int4Spec()), data, spec)
    assert "weights" not in a and b["weights"].startswith("int4 block_size=32") and a != b


def test_drafts_are_lossless_only_where_a_wide_pass_computes_like_one_row():
    """int4 segments computing with int8 activations (accuracy level 4) give a wide pass other numbers than a one-row
    pass (measured: lookup's tokens differed from int4 full depth), so the plan makes no draft configuration the
    default there and says why; fp32 artifacts and int4 at level 0 keep their lossless defaults."""
    from eectl.contracts.manifest import KVLayout, Manifest, Quantization
    from eectl.plan.choose import wide_inexact

    def manifest(level: int | None, scope: str = "segments", pad: int = 0, check: dict | None = None) -> Manifest:
        q = None
        if level is not None:
            q = Quantization(
                scope=scope, op="com.microsoft::MatMulNBits", tool="ort", bits=4, block_size=32, symmetric=False,
                accuracy_level=level, algorithm="rtn", lm_head="fp32", embedding="fp32", exit_lm_heads="fp32",
                keep_layers=[], min_agreement=0.5,
            )  # fmt: skip
        validation = {} if check is None else {"wide_exact": check}
        return Manifest.model_construct(quantization=q, kv=KVLayout.model_construct(pad=pad), validation=validation)

    assert wide_inexact(manifest(None)) == "" and wide_inexact(manifest(0)) == "" and wide_inexact(manifest(1)) == ""
    assert wide_inexact(manifest(4, scope="river")) == ""  # only the river's copies: the deep passes are fp32
    why = wide_inexact(manifest(4))
    assert "accuracy level 4" in why and "not lossless" in why and "--exact-wide" in why
    # padded one-row attention (export --exact-wide): lossless where export's check found a wide pass exact
    assert wide_inexact(manifest(4, pad=1, check={"exact": True, "max_abs_diff": 0.0})) == ""
    assert "found a wide pass differing" in wide_inexact(manifest(4, pad=1, check={"exact": False}))
    assert "did not check" in wide_inexact(manifest(4, pad=1))
    assert Int4Spec().accuracy_level == 4 and Int4Spec(accuracy_level=0).accuracy_level == 0


def test_an_inexact_artifacts_plan_defaults_to_full_depth(monkeypatch):
    from eectl.contracts.plan import Plan
    from eectl.plan import choose as choose_module

    plan = Plan(default="verify")
    monkeypatch.setattr(choose_module, "choose", lambda *a, **k: plan)
    monkeypatch.setattr(choose_module, "wide_inexact", lambda m: "int4 at level 4")
    from eectl.contracts.manifest import Manifest

    m = Manifest.model_construct(segments=[], calibration=None, certificate=None, kv_policies=["verify"])
    got = choose_module.plan_manifest(m, None)  # type: ignore[arg-type]
    assert got.default == "full" and got.inexact == "int4 at level 4"
    assert got.summary() == "plan: full depth: int4 at level 4"


def test_run_warns_where_a_policy_runs_inexact_wide_passes():
    """On int4 segments at accuracy level 4, a run whose policy sends positions through wide passes is told what that
    costs it (measured on the default model: verify 97.7% token agreement with int4 full depth, defer 97.3% step
    agreement against 99.56% calibrated): verify with exits or drafts, defer with exits; full depth, copy and any
    policy on an exact artifact are not warned."""
    from types import SimpleNamespace

    from eectl.contracts.manifest import KVLayout, Manifest, Quantization
    from eectl.run.wide import wide_warning
    from eectl.runtime.state import RunConfig

    q = Quantization(
        scope="segments", op="com.microsoft::MatMulNBits", tool="ort", bits=4, block_size=32, symmetric=False,
        accuracy_level=4, algorithm="rtn", lm_head="fp32", embedding="fp32", exit_lm_heads="fp32",
        keep_layers=[], min_agreement=0.5,
    )  # fmt: skip
    kv = KVLayout.model_construct(pad=0)
    level4 = SimpleNamespace(manifest=Manifest.model_construct(quantization=q, kv=kv, validation={}))
    level0 = q.model_copy(update={"accuracy_level": 0})
    exact = SimpleNamespace(manifest=Manifest.model_construct(quantization=level0, kv=kv, validation={}))

    def cfg(policy: str, exits: list[int], drafts: int = 0) -> RunConfig:
        return RunConfig(exits=exits, thresholds={e: {"prob": 0.9} for e in exits}, policy=policy, prompt_drafts=drafts)

    verify, lookup, defer = cfg("verify", [8]), cfg("verify", [], 4), cfg("defer", [24])
    assert "not lossless" in (wide_warning(level4, verify) or "")  # type: ignore[arg-type]
    assert "not lossless" in (wide_warning(level4, lookup) or "")  # type: ignore[arg-type]
    assert "below the calibrated rate" in (wide_warning(level4, defer) or "")  # type: ignore[arg-type]
    for quiet in (cfg("defer", []), cfg("copy", [24]), cfg("verify", [])):  # full depth, copy: no wide pass
        assert wide_warning(level4, quiet) is None  # type: ignore[arg-type]
    for config in (verify, lookup, defer):
        assert wide_warning(exact, config) is None  # type: ignore[arg-type]


def test_cached_heads_with_non_finite_weights_are_trained_again(tiny_dirs, tmp_path, monkeypatch):
    """Heads an older eectl trained to NaN (its state cache stored Gemma 3's states as inf) sit in the pipeline's
    cache under the same key: they are not restored (calibrate refused them), finite ones are."""
    import torch
    from safetensors.torch import save_file

    from eectl.contracts.heads import sidecar_path
    from eectl.pipeline.cache import PipelineCache
    from eectl.pipeline.steps import plan

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EECTL_CACHE", str(tmp_path / "cache"))
    r = Recipe(name="r", model=str(tiny_dirs["llama"]))
    p = plan(r, Path("artifacts"))
    p.heads.parent.mkdir(parents=True, exist_ok=True)
    for value, restored in ((float("nan"), False), (0.5, True)):
        save_file({"exit_2.weight": torch.full((4, 4), value)}, str(p.heads))
        sidecar_path(p.heads).write_text("{}", encoding="utf-8")
        cache = PipelineCache(r, p)
        cache.store("train-heads")
        p.heads.unlink()
        assert (cache.restore("train-heads") is not None) is restored, value
