"""The river policy on the tiny Llama: an exited token flows through the int4 copies of the remaining segments,
which write its K/V into the backbone's own buffers.

References are independent of the policy code: an int4 artifact exported with the first segment's layers kept in
fp32 holds exactly the graphs a river token runs (the same quantizer, the same settings), so stepping it by hand on
KV buffers prefilled by the fp32 artifact is what the river must reproduce, token for token; and in torch, the
runner's simulation (tests/simulation.py) with the int4 twin's layers (models/int4.py: the weights the river's
kernels multiply by) after an exit gives the river's tokens, exit layers, decisions, scores and K/V, greedy,
sampled, teacher-forced and batched."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from eectl.errors import UsageError
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.export.quantize import Int4Options
from eectl.models import load_model
from eectl.models.int4 import to_int4_twin
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from tests.simulation import Simulation, assert_cache

EXITS = [2, 4]
PROMPT = [5, 17, 33, 9, 101, 7]
NEW = 10
NEVER, ALWAYS = 2.0, -2.0  # cosine thresholds: a cosine is never >= 2, always >= -2


@pytest.fixture(scope="module")
def arts(llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("river")
    q = Int4Options(min_agreement=0.0)
    export_artifact(llama, root / "river", ExportOptions(exits=EXITS, top_k=8, river=True, int4=q))
    # layers 0..1 (segment 0) in fp32, the rest int4: the graphs a token exiting at layer 2 runs
    keep = Int4Options(min_agreement=0.0, keep_layers=(0, 1))
    export_artifact(llama, root / "ref", ExportOptions(exits=EXITS, top_k=8, weights="int4", int4=keep))
    export_artifact(llama, root / "plain", ExportOptions(exits=EXITS, top_k=8))
    # the river with fp32 compute in its kernels (accuracy level 0; the default, 4, quantizes their inputs to int8)
    level0 = Int4Options(min_agreement=0.0, accuracy_level=0)
    export_artifact(llama, root / "river0", ExportOptions(exits=EXITS, top_k=8, river=True, int4=level0))
    return {k: ArtifactRuntime(root / k, provider="cpu", threads=1) for k in ("river", "ref", "plain", "river0")}


def _run(rt, policy="river", signal="cosine", thr=ALWAYS, exits=(2,), predict="end"):
    cfg = RunConfig(
        exits=list(exits),
        thresholds={e: {"cosine": thr} for e in exits},
        signal=signal,
        policy=policy,
        max_new_tokens=NEW,
        river_predict=predict,
    )
    runner = Runner(rt, cfg)
    return runner, runner.generate([PROMPT])[0]


def _reference(arts, predict: str) -> list[int]:
    """Prefill with the fp32 graphs; every decode token through the `ref` artifact (fp32 segment 0, int4 after),
    predicted at the final head (`end`) or at exit 2 (`exit`), on the same KV buffers."""
    fp, ref = arts["river"], arts["ref"]
    kv = fp.new_kv(1, len(PROMPT) + NEW + 1)
    h = fp.embed(np.array([PROMPT]))
    for s in range(3):
        h, _ = fp.run_segment(s, h, kv, 0)
    tokens = [int(fp.exit_full(6, h[0, -1:], 8)[0].argmax())]
    while len(tokens) < NEW:
        h = ref.embed(np.array([[tokens[-1]]]))
        h0, _ = fp.run_segment(0, h, kv, 0)
        h, _ = ref.run_segment(1, h0, kv, 0)
        h, _ = ref.run_segment(2, h, kv, 0)
        at = (6, h) if predict == "end" else (2, h0)
        tokens.append(int(ref.exit_full(at[0], at[1][0, -1:], 8)[0].argmax()))
    return tokens


def test_river_that_never_fires_equals_full_depth(arts):
    _, full = _run(arts["plain"], policy="defer", exits=())
    _, g = _run(arts["river"], thr=NEVER, exits=EXITS)
    assert g.token_ids == full.token_ids and set(g.exit_layers) == {6}


@pytest.mark.parametrize("predict", ["end", "exit"])
def test_river_tokens_flow_through_the_int4_copies_and_write_kv_in_place(arts, predict):
    runner, g = _run(arts["river"], predict=predict)
    assert g.exit_layers[0] == 6 and set(g.exit_layers[1:]) == {2}  # prefill is full depth, then every token exits
    assert g.token_ids == _reference(arts, predict)
    kv = runner.last_kv
    assert kv is not None and (kv.filled[0] == len(PROMPT) + NEW - 1).all()  # every layer holds every position


class RiverSimulation(Simulation):
    """The river in torch (tests/simulation.py's early-exit decoding, its `_leave` and `_emit` replaced): after an
    exit the token's deeper layers run through `twin`'s (the int4 twin of the model, models/int4.py: the weights the
    river's MatMulNBits kernels multiply by, their int8 inputs) on its exit state, writing their K/V into the row's
    one cache; with `predict` "end" its token is the final head's on the twin's last state (the fp32 head: the
    artifact has no quantized one), else the exit's own."""

    def __init__(self, adapter, twin, exits, thresholds, predict: str = "end", **kw) -> None:
        super().__init__(adapter, exits, thresholds, policy="defer", **kw)
        self.twin, self.predict, self.end = twin, predict, None

    def _leave(self, f, e: int) -> None:
        for lo, hi in (seg for seg in self.segments if seg[0] >= e):
            f.h = self.twin.forward_layers(f.h, f.pos, lo, hi, f.row.cache)
        self.end = f.h

    def _emit(self, r, layer: int, full, exit_pick) -> None:
        if layer < self.L and self.predict == "end":  # the river's end: its logits [V], sampled or forced as the head's
            full, exit_pick = self.heads[self.L].full(self.end[0, -1:])[0], None
        super()._emit(r, layer, full, exit_pick)


@pytest.fixture(scope="module")
def twins(tiny_dirs, arts):
    """River artifact -> the tiny Llama's int4 twin for its quantization settings (each its own copy of the model)."""
    return {k: to_int4_twin(load_model(str(tiny_dirs["llama"])), arts[k].manifest.quantization).adapter for k in RIVERS}


RIVER_THRESHOLDS = {2: {"cosine": 0.6}, 4: {"cosine": 0.85}}  # measured: tokens at 2 (most runs), 4 and 6 (all)
RIVER_NEW = 16
# river artifact -> how far its K/V may stand from the twin's: with int8 inputs (level 4) float rounding in the
# kernel's order can move a value across an int8 rounding step (tests/test_int4_twin.py: logits within 6e-3; 3.4e-4
# measured here), with fp32 compute (level 0) only float rounding remains (1.5e-6 measured)
RIVERS = {"river": 6e-3, "river0": 1e-4}


@pytest.mark.parametrize("river", sorted(RIVERS))
@pytest.mark.parametrize("predict", ["end", "exit"])
def test_river_steps_equal_the_int4_twin_simulation(llama, arts, twins, river, predict):
    """The river (the bound chain's steps, its int4 copies from the policy's `predict` hook), greedy, sampled and
    teacher-forced, one row and a batch: the tokens, exit layers, decisions, scores and every layer's K/V (the river's
    included) of the torch simulation running the int4 twin's layers after an exit; some tokens exiting at each exit
    and some not. The reference tells the river from fp32 layers: those write other K/V."""
    rt, twin, tol, L = arts[river], twins[river], RIVERS[river], 6
    seen: set[int] = set()

    def reference(temperature: float = 0.0, deeper=twin) -> RiverSimulation:
        thr = RIVER_THRESHOLDS
        return RiverSimulation(llama.adapter, deeper, EXITS, thr, predict, signal="cosine", temperature=temperature)

    for temperature in (0.0, 0.9):
        cfg = RunConfig(
            exits=EXITS,
            thresholds=RIVER_THRESHOLDS,
            signal="cosine",
            policy="river",
            max_new_tokens=RIVER_NEW,
            river_predict=predict,
            temperature=temperature,
        )
        runner = Runner(rt, cfg)
        gen = runner.generate([PROMPT])[0]
        ref = reference(temperature).generate([PROMPT], RIVER_NEW)[0]
        assert any(x < L for x in ref.layers[1:]) and L in ref.layers[1:], ref.layers  # some exit, some do not
        seen |= set(ref.layers[1:])
        assert gen.token_ids == ref.tokens and gen.exit_layers == ref.layers, temperature
        assert gen.decided == ref.decided
        assert_cache(runner.last_kv, 0, ref, rt.manifest, tol=tol, whole=True)
        ids = PROMPT + gen.token_ids
        scored = runner.score_many([(ids, len(PROMPT))])[0]
        forced = reference().score(ids, len(PROMPT))
        assert scored.layers == forced.layers and scored.greedy == forced.greedy
        np.testing.assert_allclose(scored.nll, forced.nll, rtol=tol, atol=tol)
        # the fp32 model's deeper layers after an exit (no river) write K/V the comparisons here would refuse
        fp32 = reference(deeper=llama.adapter).score(ids, len(PROMPT))
        drift = max(float((forced.cache.keys[i] - fp32.cache.keys[i]).abs().max()) for i in range(EXITS[0], L))
        assert drift > 10 * tol, drift
    assert seen == {2, 4, L}, seen  # tokens decided at every depth
    prompts = [PROMPT, [9, 4, 77, 12], [31, 8, 2, 64, 5, 19, 3, 40]]  # a batch: the river's copies run per row
    runner = Runner(rt, dataclasses.replace(cfg, temperature=0.0))
    rows = runner.generate(prompts)
    for r, (gen, ref) in enumerate(zip(rows, reference().generate(prompts, RIVER_NEW), strict=True)):
        assert gen.token_ids == ref.tokens and gen.exit_layers == ref.layers, r
        assert gen.decided == ref.decided, r
        assert_cache(runner.last_kv, r, ref, rt.manifest, tol=tol, whole=True)


def test_river_end_differs_from_fp32_only_through_int4(arts):
    """Sanity of the reference itself: the int4 river changes the logits (else the test above proves nothing)."""
    fp, ref = arts["plain"], arts["ref"]
    kv1, kv2 = fp.new_kv(1, 8), fp.new_kv(1, 8)
    h = fp.embed(np.array([PROMPT]))
    a, _ = fp.run_segment(1, fp.run_segment(0, h, kv1, 0)[0], kv1, 0)
    b, _ = ref.run_segment(1, fp.run_segment(0, h, kv2, 0)[0], kv2, 0)
    assert 0 < np.abs(a - b).max() < 0.5 * np.abs(a).max()


def test_river_needs_river_copies(arts):
    with pytest.raises(UsageError, match="river"):
        _run(arts["plain"])


def test_segment_block_states_equal_torch(llama, arts):
    """The segment graphs' `layer_states` (River's min-cosine input) are the residual stream at every block
    boundary, as the adapter's layer-range forward computes it."""
    import torch

    from eectl.models import KVCache

    rt = arts["plain"]
    ids = torch.tensor([PROMPT])
    states: dict[int, torch.Tensor] = {}

    def grab(i: int, h_in: torch.Tensor, h_out: torch.Tensor) -> None:
        states[i] = h_in
        states[i + 1] = h_out

    with torch.no_grad():
        a = llama.adapter
        a.forward_layers(a.embed(ids), torch.arange(len(PROMPT))[None], 0, a.num_layers, KVCache(), on_layer=grab)
    kv = rt.new_kv(1, 8)
    h = rt.embed(ids.numpy())
    for s, seg in enumerate(rt.manifest.segments):
        h, _, blocks = rt.run_segment(s, h, kv, 0, states=True)
        lo, hi = seg.layers
        assert blocks.shape == (hi - lo + 1, len(PROMPT), a.dims.hidden_size)
        for j in range(hi - lo + 1):
            np.testing.assert_allclose(blocks[j], states[lo + j][0].numpy(), atol=1e-4)


def test_costs_time_the_river_copies_and_model_the_river(arts):
    from eectl.plan.choose import predict
    from eectl.plan.costs import measure_costs

    rt = arts["river"]
    c = measure_costs(rt, past=8, repeats=2, warmup=1, signal="cosine")
    assert c.river_ms is not None and c.river_ms[0] is None  # segment 0 runs in fp32 before any exit
    assert all(ms is not None and ms > 0 for ms in c.river_ms[1:]) and c.river_head_ms is None
    boundaries = [s.layers[1] for s in rt.manifest.segments]
    assert predict(c, boundaries, "river", [(2, 1.0, None)]).speedup > 0
    plain = measure_costs(arts["plain"], past=8, repeats=1, warmup=0, signal="cosine")
    assert plain.river_ms is None
    # a cosine decision reads block states; the exit's LM head is timed apart, for tokens taking their own prediction
    assert c.exit_predict_ms is not None and set(c.exit_predict_ms) == {str(e) for e in rt.manifest.exit_layers}
    blocks = measure_costs(rt, past=8, repeats=1, warmup=0, signal="cosine-min")  # over each segment's blocks
    assert blocks.exit_predict_ms is not None and all(ms > 0 for ms in blocks.candidates_ms.values())
    topk = measure_costs(rt, past=8, repeats=1, warmup=0, signal="topk-prob")
    assert topk.exit_predict_ms is None  # the candidates carry the token
    # one-row exit steps run on the bound chain whatever the signal: the softmax decided in the exit graphs (timed
    # as the chain's bound calls), the cosines on the host (timed as the host's exit test)
    assert topk.bound_exits and c.bound_exits and blocks.bound_exits
    assert set(topk.local_ms) == set(topk.candidates_ms) and all(ms > 0 for ms in topk.local_ms.values())


def test_bench_river_side_by_side_with_int4_and_kv_cosine(arts):
    """One bench run: full, an int4 artifact at full depth (--compare), river at both prediction points, defer;
    river's K/V compared with the exact K/V per layer."""
    import json

    from typer.testing import CliRunner

    from eectl.cli import app
    from tests.tiny import GSM8K

    args = ["bench", str(arts["river"].folder), "--data", str(GSM8K), "--prompts", "2", "--max-new-tokens", "8"]
    args += ["--reps", "1", "--signal", "cosine-min", "--thresholds", "-1", "--sweep", "", "--ppl-tokens", "32"]
    args += ["--policies", "full,river,river-exit,defer", "--compare", f"int4={arts['ref'].folder}", "--raw"]
    res = CliRunner().invoke(app, [*args, "--json", "--threads", "1"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    by = {c["name"]: c for c in doc["configs"]}
    # full-aa: the A/A control; exact-head: full depth without the certified head
    assert list(by) == ["full", "full-aa", "river", "river-exit", "defer", "int4", "exact-head"]
    assert by["river"]["mean_layers"] == 2.0 and by["river"]["perplexity"] is not None  # every token exits at 2
    kvr = doc["river_kv"]
    assert kvr["exited"] == kvr["tokens"] - 1 and len(kvr["layers"]) == 6
    assert kvr["layers"][0]["river_positions"] == 0 and kvr["layers"][0]["key_cosine_river"] is None
    assert kvr["layers"][2]["river_positions"] == kvr["exited"]  # layers 2.. were written by the river
    assert -1.0 <= kvr["min_river_cosine"] < 1.0
    assert kvr["layers"][0]["key_cosine_generated"] == pytest.approx(1.0, abs=1e-5)  # fp32 segment 0: exact
    # every token exits at 2: the cost model at the realized exits prices the river's int4 copies
    assert by["river"]["model_speedup"] is not None and by["river-exit"]["model_speedup"] is not None


def test_cosine_min_calibrates_as_the_minimum_over_each_segments_blocks(llama):
    """calibrate's `cosine-min` values are the minimum, over the blocks since the previous exit, of the blocks'
    transition cosines (so never above the last block's, which is the `cosine` signal)."""
    import torch

    from eectl.exits.base import transition_cosine
    from eectl.exits.measure import ExitScorer, measure_text
    from eectl.models import KVCache

    g = torch.Generator().manual_seed(3)
    chunks = [torch.randint(3, llama.adapter.dims.vocab_size, (1, 12), generator=g) for _ in range(2)]
    mins = measure_text(ExitScorer(llama.adapter, EXITS, "cosine-min", 8), chunks)
    last = measure_text(ExitScorer(llama.adapter, EXITS, "cosine", 8), chunks)
    assert mins is not None and last is not None
    assert (mins.values["cosine"] <= last.values["cosine"] + 1e-6).all()
    assert (mins.values["cosine"] < last.values["cosine"] - 1e-4).any()
    cos: dict[int, torch.Tensor] = {}

    def grab(i: int, h_in: torch.Tensor, h_out: torch.Tensor) -> None:
        cos[i] = transition_cosine(h_in, h_out)[0, 1:]

    with torch.no_grad():
        a = llama.adapter
        a.forward_layers(a.embed(chunks[0]), torch.arange(12)[None], 0, a.num_layers, KVCache(), on_layer=grab)
    want = torch.stack([torch.stack([cos[0], cos[1]]).min(0).values, torch.stack([cos[2], cos[3]]).min(0).values])
    torch.testing.assert_close(mins.values["cosine"][:, :11], want, atol=1e-5, rtol=0)


def test_river_head_in_int4_is_used_at_the_rivers_end_only(llama, tmp_path):
    q = Int4Options(min_agreement=0.0, lm_head="int4")
    m = export_artifact(llama, tmp_path / "r", ExportOptions(exits=EXITS, top_k=8, river=True, int4=q))
    final = m.exits[-1]
    assert final.river is not None and "weight" not in final.river.inputs and "weight" in final.full.inputs
    assert all(e.river is None for e in m.exits[:-1]) and m.validation["river"]["passed"]
    rt = ArtifactRuntime(tmp_path / "r", provider="cpu", threads=1)
    h = np.random.default_rng(0).standard_normal((1, llama.adapter.dims.hidden_size)).astype(np.float32)
    a, b = rt.exit_full(6, h, 8)[0], rt.exit_full(6, h, 8, river=True)[0]
    assert 0 < np.abs(a - b).max() < 0.2 * np.abs(a).max()  # int4 rounding of the head, visible and bounded
    _, g = _run(rt)
    assert set(g.exit_layers[1:]) == {2} and len(g.token_ids) == NEW


THRESHOLD = {"cosine": 0.8, "cosine-min": 0.65}  # measured: some tokens exit at 4, some run to 6


@pytest.mark.parametrize("signal", ["cosine", "cosine-min"])
def test_batch_rows_equal_rows_alone_every_policy(arts, signal):
    """Batched rows give each row its tokens and exits alone under every policy of a --river artifact, with the
    cosine signals (cosine-min reads the block states of the batched segment call; river's copies run per row)."""
    rt = arts["river"]
    prompts = [PROMPT, [9, 4, 77, 12], [31, 8, 2, 64, 5, 19, 3, 40], [11]]
    thr = {e: {"cosine": THRESHOLD[signal]} for e in EXITS}
    mixed = []
    for policy in rt.manifest.kv_policies:
        for predict in ("end", "exit") if policy == "river" else ("end",):

            def runner(policy=policy, predict=predict):
                cfg = RunConfig(
                    exits=EXITS, thresholds=thr, signal=signal, policy=policy, max_new_tokens=NEW, river_predict=predict
                )
                return Runner(rt, cfg)

            alone = [runner().generate([p])[0] for p in prompts]
            batch = runner().generate(prompts)
            assert [g.token_ids for g in batch] == [g.token_ids for g in alone], (policy, predict)
            assert [g.exit_layers for g in batch] == [g.exit_layers for g in alone], (policy, predict)
            mixed.append(sorted({x for g in batch for x in g.exit_layers[1:]}))
    assert all(len(m) > 1 for m in mixed), mixed  # tokens exited at different depths under every policy


@pytest.mark.parametrize("signal", ["cosine", "cosine-min"])
def test_river_runs_device_resident_with_the_host_paths_tokens(arts, signal):
    """The plan-executing path (states as device values; here CPU OrtValues) under river, both predictions, one row
    and batched: the host path's tokens and exits, and the river's end reads only its greedy token."""
    rt = arts["river"]
    prompts = [PROMPT, [9, 4, 77, 12], [31, 8, 2, 64, 5, 19, 3, 40]]
    thr = {e: {"cosine": THRESHOLD[signal]} for e in EXITS}
    for predict in ("end", "exit"):
        for rows in (prompts[:1], prompts):
            runs = []
            for resident in (False, True):
                cfg = RunConfig(
                    exits=EXITS,
                    thresholds=thr,
                    signal=signal,
                    policy="river",
                    max_new_tokens=NEW,
                    river_predict=predict,
                    device_resident=resident,
                )
                runner = Runner(rt, cfg)
                runs.append((runner, runner.generate(rows)))
            (_, host), (runner, got) = runs
            assert [g.token_ids for g in got] == [g.token_ids for g in host], (predict, len(rows))
            assert [g.exit_layers for g in got] == [g.exit_layers for g in host], (predict, len(rows))
            assert any(x < rt.manifest.num_layers for g in got for x in g.exit_layers[1:])
            reads = {(graph, key) for step in runner.step_reads for graph, _, key in step}
            # scalars per row only (the certified head's `passed` where the artifact has one: the bound chain's)
            assert {key for _, key in reads} <= {"token", "candidates", "candidate_logits", "cosine", "passed"}, reads
            head = "river_head" if rt.manifest.num_layers in rt.river_heads else "exit_full"
            assert predict == "exit" or (head, "token") in reads, reads  # the river's end: its token alone
            # full-depth tokens: the certified head's where the artifact has one (the bound chain's), else the head's
            assert {("head_certified", "token"), ("exit_full", "token")} & reads, reads


def test_a_river_artifact_with_a_plan_runs_its_river(arts, llama):
    """The plan prices copy, defer and verify only: --policy river runs on the calibration's exits (#34: it used to
    say '--policy must be one of copy, defer, verify')."""
    from eectl.contracts.plan import Choice, Plan, Prediction
    from eectl.run.generate import RunOptions, resolve_config
    from tests.conftest import make_calibration

    rt = ArtifactRuntime(arts["river"].folder, provider="cpu", threads=1)
    full = Prediction(policy="verify", exits=[], ms_per_token=1.0, full_ms=1.0, speedup=1.0, decision_ms=0.0,
                      exit_rate=0.0)  # fmt: skip
    verify = Choice(policy="verify", exits=[], thresholds={}, option=None, prediction=full)
    rt.manifest.plan = Plan(default="full", choices={"verify": verify})  # what export plans: no river choice
    rt.manifest.calibration = make_calibration(llama, {e: {"prob": 0.5} for e in EXITS})
    cfg = resolve_config(rt, RunOptions(policy="river"), ())
    assert cfg.policy == "river" and cfg.exits == EXITS and not cfg.planned
