"""Candidate sources (exits/candidates.py) against their exit graphs (export/graphs.py) in ONNX Runtime, the menu of
exit
subsets calibrate writes, and the plan export writes and run follows."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from onnx import TensorProto

from eectl.calibrate.calibrator import CalibrateOptions, calibrate_model
from eectl.data import token_chunks
from eectl.exits.base import ExitHead, passes, signals
from eectl.exits.candidates import (
    WEIGHT_LEVELS,
    Int8Ranking,
    Shortlist,
    ShortlistInt8,
    frequency_shortlist,
    int8_scores,
    quantize_activations_int8,
    quantize_rows_int8,
)
from eectl.exits.measure import ExitScorer, measure_text
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.run.generate import RunOptions, resolve_config
from eectl.runtime.binding import plan_for
from eectl.runtime.ort import _ort, session_options
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig

K = 8
SOURCES = ("shortlist", "shortlist-int8", "int8")  # the cheap candidate sources, each calibrated and exported below


def test_frequency_shortlist_ranks_by_count_then_id():
    ids = torch.tensor([5, 3, 5, 9, 3, 5, 1])
    assert frequency_shortlist(ids, 3, 10).tolist() == [5, 3, 1]  # 1 and 9 tie: the lower id first
    # fewer distinct ids than asked: topped up with the lowest unseen ids; never beyond the vocabulary
    assert frequency_shortlist(ids, 6, 10).tolist() == [5, 3, 1, 9, 0, 2]
    assert frequency_shortlist(ids, 50, 10).numel() == 10


def test_int8_scores_are_the_exact_integer_product_of_each_row_quantized_alone():
    """int8_scores = (q(x) @ q(W).T) * (x_scale * w_scale) with the integer product exact (summed in int64 here), each
    row of x quantized symmetrically on its own: integers in [-127, 127] that dequantize to x within half a step."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 2000, generator=g)  # H = 2000: more terms than one exact float32 partial sum holds
    x = torch.randn(5, 2000, generator=g) * torch.tensor([1e-3, 1.0, 3.0, 1e3, 0.0])[:, None]
    q, scale = quantize_rows_int8(weight)
    # the weights on 7 bits (WEIGHT_LEVELS = 63): each row's peak maps to 63, the product exact on AVX2's kernel
    assert q.dtype == torch.int8 and q.abs().max() <= WEIGHT_LEVELS == 63
    assert (q.abs().amax(dim=1) == WEIGHT_LEVELS).all()
    torch.testing.assert_close(q.float() * scale[:, None], weight, atol=float(scale.max()) / 2 + 1e-6, rtol=0)
    xq, xscale = quantize_activations_int8(x)
    assert xq.abs().max() <= 127 and torch.equal(xq, xq.round())
    assert (xq.abs().amax(dim=1)[:4] == 127).all() and (xq[4] == 0).all()  # each row's peak maps to 127; zeros to 0
    assert ((xq * xscale[:, None] - x).abs() <= xscale[:, None] / 2 * (1 + 1e-6)).all()
    exact = (xq.long() @ q.long().T).float() * scale[None, :] * xscale[:, None]
    assert torch.equal(int8_scores(x, q, scale), exact)
    for row in range(x.shape[0]):  # per row: a row's scores do not depend on the rows beside it
        assert torch.equal(int8_scores(x[row : row + 1], q, scale)[0], exact[row])


def _rows_of_different_shapes(h: int, seed: int) -> torch.Tensor:
    """[6, h] rows whose ranges differ by orders of magnitude, also after a final norm (which rescales each row):
    Gaussian rows of scale 1e-3 and 1e3, a row with one large positive spike, one with a large negative spike, an
    all-positive row and an all-zero row."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(6, h, generator=g)
    rows[0] *= 1e-3
    rows[1] *= 1e3
    rows[2, 5] = 300.0
    rows[3, 9] = -300.0
    rows[4] = rows[4].abs() + 0.5
    rows[5] = 0.0
    return rows


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_int8_graph_quantizes_each_row_as_torch_does(dtype):
    """export_graphs._int8_scores equals candidates.int8_scores bit for bit on a batch of rows of very different
    ranges, called together or one by one: each row has its own scale and zero point (the integer product exact,
    the scales multiplied in the same order). fp16: the graph quantizes the fp16 input cast to float32, as torch."""
    from eectl.export.candidate_graphs import _int8_scores
    from eectl.export.graphs import DTYPES, _Builder

    g = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 48, generator=g)
    weight[0] = 1.0  # with the all-ones row of x below: every product at its peak (uint8 255 x int8 63), where an
    # int8 weight of 127 overflowed the int16 pair sums of ORT's AVX2 kernel (wrong scores on a CPU without VNNI)
    q, scale = quantize_rows_int8(weight)
    b = _Builder(dtype)
    b.input("x", None, ["n", 48])
    b.output(_int8_scores(b, "x", q, scale), "y", TensorProto.FLOAT, ["n", 300])
    sess = _ort().InferenceSession(b.model("int8").SerializeToString(), sess_options=session_options())
    sym = torch.randn(1, 48, generator=g).clamp(-2, 2)
    sym[0, :2] = torch.tensor([-3.0, 3.0])  # both ends of the range: -127 and 127, uint8 1 and 255
    spread = torch.randn(100, 48, generator=g) * torch.logspace(-3, 3, 100)[:, None] + torch.randn(100, 1, generator=g)
    peak = torch.ones(1, 48)
    x = torch.cat([_rows_of_different_shapes(48, 2), sym, spread, peak]).numpy().astype(DTYPES[dtype][1])
    want = int8_scores(torch.from_numpy(x).float(), q, scale).numpy()
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], want)
    for row in range(x.shape[0]):
        np.testing.assert_array_equal(sess.run(None, {"x": x[row : row + 1]})[0][0], want[row])


@pytest.fixture(scope="module")
def calibrations(llama, gsm8k):
    """Tiny-llama calibrations with each cheap source (shortlist of 64 rows), the menu included."""
    out = {}
    for source in SOURCES:
        opts = CalibrateOptions(
            exits=[2, 3, 4], target=0.5, tokens=1500, top_k=K, candidates=source, shortlist=64, confidence=None
        )
        out[source] = calibrate_model(llama, gsm8k, opts)
    return out


def test_shortlist_is_ranked_on_calibration_tokens(calibrations, llama):
    cal = calibrations["shortlist"]
    assert cal.candidates is not None and cal.candidates.name == "shortlist" and cal.candidates.size == 64
    assert len(set(cal.candidates.ids or [])) == 64
    ranked = calibrations["shortlist-int8"].candidates  # the same shortlist, ranked by its int8 rows at run time
    assert ranked is not None and ranked.name == "shortlist-int8" and ranked.ids == cal.candidates.ids
    assert calibrations["int8"].candidates is not None and calibrations["int8"].candidates.ids is None


@torch.no_grad()
def test_menu_options_are_what_a_run_with_only_those_exits_measures(llama, gsm8k):
    """Subsets are fitted on measurements with the candidates picked at the subset's own first exit."""
    adapter = llama.adapter
    source = Shortlist(torch.arange(0, 200))
    chunks = token_chunks(llama.tokenizer, gsm8k, 300, 100)
    wide = measure_text(ExitScorer(adapter, [1, 3, 5], "topk-prob+margin", K, source=source), chunks, pairs=True)
    alone = measure_text(ExitScorer(adapter, [3, 5], "topk-prob+margin", K, source=source), chunks)
    assert wide is not None and alone is not None
    sub = wide.restrict([3, 5])
    for c in ("prob", "margin"):
        torch.testing.assert_close(sub.values[c], alone.values[c])
    assert torch.equal(sub.correct, alone.correct)
    # the first-exit slice is the ordinary measurement
    plain = measure_text(ExitScorer(adapter, [1, 3, 5], "topk-prob+margin", K, source=source), chunks)
    assert plain is not None and torch.equal(wide.correct, plain.correct)


def test_menu_holds_target_and_verify_options(calibrations):
    options = calibrations["shortlist"].options
    kinds = {o.kind for o in options}
    assert kinds <= {"target", "verify"} and "verify" in kinds
    assert all(len(o.exits) <= 3 and o.exits == sorted(o.exits) for o in options)
    for o in options:
        assert all(x.thresholds["prob"] < float("inf") for x in o.per_exit)
        assert 0.0 <= o.exit_rate <= 1.0


@pytest.fixture(scope="module")
def planned(llama, calibrations, tmp_path_factory):
    root = tmp_path_factory.mktemp("planned")
    out = {}
    for source, cal in calibrations.items():
        export_artifact(llama, root / source, ExportOptions(exits=[2, 3, 4], top_k=K), calibration=cal)
        out[source] = ArtifactRuntime(root / source, provider="cpu")
    return out


@pytest.mark.parametrize("source", SOURCES)
def test_candidate_graph_equals_the_torch_source(planned, llama, calibrations, source):
    rt = planned[source]
    m = rt.manifest
    assert m.candidate_source["name"] == source
    v = m.validation
    # export checked every position of its validation text in one call per exit and chunk (a batch of rows), and the
    # last position alone as well: the same candidates as torch's, and alone as in the batch
    assert v["candidate_checks"] > 100 and v["candidate_set_mismatches"] == 0
    assert v["candidate_batch_vs_alone_mismatches"] == 0
    assert v["candidate_logit_max_abs_diff"] < 1e-4
    ids = m.candidate_source.get("ids")
    weight = llama.adapter.lm_head.weight
    src = {
        "shortlist": lambda: Shortlist(torch.tensor(ids)),
        "shortlist-int8": lambda: ShortlistInt8(torch.tensor(ids), weight),
        "int8": lambda: Int8Ranking(weight),
    }[source]()
    hidden = torch.randn(6, llama.adapter.dims.hidden_size, generator=torch.Generator().manual_seed(3))
    for layer in (2, 3):
        head = ExitHead(llama.adapter)
        want_c, want_l = src.torch_pick(head, hidden, K)
        for row in range(hidden.shape[0]):  # one token per call (a batch: the test below)
            got_c, got_l = rt.exit_candidates(layer, hidden[row : row + 1].numpy(), K)
            assert got_c[0].tolist() == want_c[row].tolist()
            np.testing.assert_allclose(got_l[0], want_l[row].numpy(), rtol=1e-4, atol=1e-4)


def _per_tensor_pick(source, head: ExitHead, hidden: torch.Tensor, k: int) -> torch.Tensor:
    """What an int8 source would pick with one scale for the whole batch (per-tensor quantization): [N, K] ids. The
    rows as one row of N * H values quantize with the batch's range."""
    normed = head.normed(hidden)
    n, h = normed.shape
    xq, xscale = quantize_activations_int8(normed.reshape(1, n * h))
    approx = (xq.reshape(n, h).double() @ source.qweight.double().T).float() * (xscale * source.scale[None, :])
    top = torch.topk(approx, k, dim=-1).indices
    return source.ids[top] if isinstance(source, Shortlist) else top


@pytest.mark.parametrize("source", ["shortlist-int8", "int8"])
def test_int8_candidate_graph_picks_each_row_of_a_batch_as_alone(planned, llama, source):
    """The int8 sources' candidate graphs quantize each row on its own: a batch of rows of very different ranges
    gets, in one call, exactly each row's candidates alone and the torch source's; per-tensor quantization (one
    scale for the batch) would pick other candidates for some row of this batch, so the check can fail.
    Candidate logits: the same fp32 rows summed in another order (ORT's batched MatMul vs torch), atol 1e-4."""
    rt = planned[source]
    ids = rt.manifest.candidate_source.get("ids")
    weight = llama.adapter.lm_head.weight
    src = ShortlistInt8(torch.tensor(ids), weight) if source == "shortlist-int8" else Int8Ranking(weight)
    # not the all-zero row: every score ties there, and torch's and ORT's Top-K order ties differently
    hidden = _rows_of_different_shapes(llama.adapter.dims.hidden_size, 4)[:5]
    for layer in (2, 3):
        head = ExitHead(llama.adapter)
        want_c, want_l = src.torch_pick(head, hidden, K)
        assert not torch.equal(_per_tensor_pick(src, head, hidden, K), want_c)
        got_c, got_l = rt.exit_candidates(layer, hidden.numpy(), K)
        assert got_c.tolist() == want_c.tolist()
        np.testing.assert_allclose(got_l, want_l.numpy(), rtol=1e-4, atol=1e-4)
        for row in range(hidden.shape[0]):
            alone_c, alone_l = rt.exit_candidates(layer, hidden[row : row + 1].numpy(), K)
            assert alone_c[0].tolist() == got_c[row].tolist()
            np.testing.assert_allclose(alone_l[0], got_l[row], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("source", ["shortlist", "shortlist-int8"])
def test_a_token_outside_the_shortlist_never_exits(planned, source):
    rt = planned[source]
    shortlist = set(rt.manifest.candidate_source["ids"])
    cfg = RunConfig(exits=[2], thresholds={2: {"prob": 0.0}}, top_k=K, max_new_tokens=20)  # every token exits
    g = Runner(rt, cfg).generate([[1, 7, 30, 2, 99]])[0]
    assert g.exit_layers[1:] == [2] * 19 and set(g.token_ids[1:]) <= shortlist


def test_costs_and_plan_are_in_the_manifest_and_run_follows_the_plan(planned):
    rt = planned["shortlist"]
    m = rt.manifest
    assert m.costs is not None and m.plan is not None
    c = m.costs
    assert len(c.segment_ms) == len(m.segments) == len(c.kv_ms) == len(c.segment_extra_ms)
    assert set(c.candidates_ms) == set(c.local_ms) == {"2", "3", "4"} and c.full_step_ms > 0
    assert set(c.gate_ms) == {"2", "3", "4"} and all(v > 0 for v in c.gate_ms.values())  # each exit's gate test
    assert c.chain_step_ms is not None and c.chain_step_ms > 0  # the bound full-depth path, the baseline
    assert set(m.plan.choices) == {"copy", "defer", "verify"}
    cfg = resolve_config(rt, RunOptions(), ())
    assert cfg.planned and cfg.note.startswith("plan:")
    want = m.plan.choices.get(m.plan.default)
    assert cfg.exits == (want.exits if want is not None else [])
    # a policy whose best option does not pay runs at full depth, and says so
    m.plan.choices["verify"].exits = []
    m.plan.choices["verify"].thresholds = {}
    cfg = resolve_config(rt, RunOptions(policy="verify"), ())
    assert cfg.exits == [] and "running at full depth" in cfg.note
    # explicit exits and thresholds bypass the plan
    cfg = resolve_config(rt, RunOptions(exits="3", thresholds="0.5"), ())
    assert cfg.exits == [3] and not cfg.planned


def test_costs_keep_every_round_and_time_more_while_the_plan_is_undecided(planned):
    from eectl.plan.costs import _minus, measure_costs
    from eectl.run.generate import replan

    rt = planned["shortlist"]
    asked: list[int] = []

    def decided(costs) -> bool:  # undecided twice, then decided
        asked.append(costs.rounds())
        return len(asked) == 3

    c = measure_costs(rt, past=8, repeats=2, warmup=0, decided=decided, budget_s=3600)
    assert asked == [2, 4, 6] and c.rounds() == 6 and c.repeats == 6
    s = c.samples_ms
    assert s is not None and c.segment_ms[1] == pytest.approx(float(np.median(s["segment_ms.1"])))
    assert c.chain_step_ms == pytest.approx(float(np.median(s["chain_step_ms"])))
    assert c.candidates_ms["3"] == pytest.approx(float(np.median(s["candidates_ms.3"])))
    # one more position: per-round differences (seg2 - seg1 in the same round), their median the point estimate
    assert len(s["segment_extra_ms.0"]) == 6
    assert c.segment_extra_ms[0] == pytest.approx(float(np.median(s["segment_extra_ms.0"])))
    assert _minus([3.0, 1.0, 2.5], [1.0, 2.0, 2.0]) == [2.0, 0.0, 0.5]  # paired by round, a negative one floored
    # out of time budget: one batch of rounds, whatever the plan says
    assert measure_costs(rt, past=8, repeats=2, warmup=0, decided=lambda _: False, budget_s=0).rounds() == 2
    # `--profile-costs`: re-measured costs carry their samples, and the plan its intervals
    fresh = ArtifactRuntime(rt.folder, provider="cpu")
    replan(fresh, budget_s=0)
    m = fresh.manifest
    assert m.costs is not None and m.costs.rounds() >= 2 and m.plan is not None
    bests = [ch.best for ch in m.plan.choices.values() if ch.best is not None]
    assert bests and all(b.interval is not None for b in bests)


def test_each_exit_decision_is_timed_right_after_its_segment(planned):
    """The cost model times an exit's decision just after its segment's call, as a decode step makes it (the
    segment's weights through the caches first), and not that segment's time: prelude untimed."""
    from eectl.plan.costs import _time_rounds, after_segments

    rt = planned["shortlist-int8"]
    log: list[str] = []
    calls = {f"seg1.{i}": (lambda i=i: log.append(f"seg1.{i}")) for i in range(len(rt.manifest.segments))}
    calls |= {f"{kind}.{e}": (lambda n=f"{kind}.{e}": log.append(n)) for kind in ("cand", "local") for e in (2, 3)}
    timed = after_segments(calls, rt)
    assert timed["cand.3"] == (calls[f"seg1.{rt.segment_of_layer[3]}"], calls["cand.3"])
    _time_rounds(timed, 1, 0, {n: [] for n in timed})
    for name in ("cand.2", "local.2", "cand.3", "local.3"):
        at = log.index(name)
        assert log[at - 1] == f"seg1.{rt.segment_of_layer[int(name.split('.')[1])]}"

    def slow() -> None:
        time.sleep(0.05)

    times: dict[str, list[float]] = {"x": []}
    _time_rounds({"x": (slow, lambda: None)}, 2, 0, times)
    assert len(times["x"]) == 2 and max(times["x"]) < 25  # ms: the prelude's 50 ms are not in it


def test_compared_source_is_measured_on_the_same_tokens(llama, gsm8k, calibrations):
    """--compare int8 in a shortlist calibration gives what an int8 calibration on the same data measures."""
    opts = CalibrateOptions(
        exits=[2, 3, 4],
        target=0.5,
        tokens=1500,
        top_k=K,
        candidates="shortlist",
        shortlist=64,
        confidence=None,
        compare=["int8"],
    )
    cal = calibrate_model(llama, gsm8k, opts)
    assert set(cal.compared) == {"int8"}
    alone = calibrations["int8"]
    got = cal.compared["int8"]
    assert got.calibration == alone.calibration and got.heldout == alone.heldout
    assert [x.thresholds for x in got.exits] == [x.thresholds for x in alone.exits]
    assert len(got.options) == len([o for o in alone.options if not o.gated])  # compared sources: no gates
    assert cal.calibration == calibrations["shortlist"].calibration  # the main source is unchanged


@pytest.mark.parametrize("source", SOURCES)
def test_batched_rows_equal_rows_alone_with_a_candidate_source(planned, source):
    """A batch picks each row's candidates as the row alone would (one candidate-graph call for all rows: int8
    quantizes each row on its own); so does the plan-executing path (device-resident states), which reads each
    decision's flag and token only."""
    rt = planned[source]
    prompts = [[1, 7, 30, 2, 99], [5, 9], [44, 3, 8, 61, 2, 17, 90], [12]]
    cfg = RunConfig(  # the full head's reads, as a device plan names them (the certified head runs on the CPU EP)
        exits=[2, 3],
        thresholds={2: {"prob": 0.15}, 3: {"prob": 0.15}},
        top_k=K,
        max_new_tokens=12,
        certified_head=False,
    )
    singles = [Runner(rt, cfg) for _ in prompts]
    alone = [r.generate([p])[0] for r, p in zip(singles, prompts, strict=True)]
    batch = Runner(rt, cfg).generate(prompts)
    assert [g.token_ids for g in batch] == [g.token_ids for g in alone]
    assert [g.exit_layers for g in batch] == [g.exit_layers for g in alone]
    resident = Runner(rt, replace(cfg, device_resident=True))
    assert [g.token_ids for g in resident.generate(prompts)] == [g.token_ids for g in batch]
    reads = {(graph, key) for step in resident.step_reads for graph, _, key in step}
    # the candidate graph decides: one flag and one token per row leave it, the K ids stay for the later exit
    assert ("candidates", "passed") in reads and {k for _, k in reads} <= {"passed", "exit_token", "token"}
    layers = {x for g in batch for x in g.exit_layers[1:]}
    assert len(layers) > 1, layers  # rows at different depths
    # alone, a row decodes on the bound chain; with an int8 source the second exit scores the K rows the first
    # gathered (its graph's table bound to them, candidates 0..K-1), as the batch above decided
    runner = Runner(rt, cfg)
    chain = runner._chain(runner.rt.new_kv(1, 32), 1)
    assert chain is not None
    second = chain.exits[rt.segment_of_layer[3]]
    assert (second.ids is not None) == (source != "shortlist")  # the shortlist's graph gathers no rows
    assert any(3 in g.exit_layers[1:] for g in alone)  # tokens that exited there
    # what each of those steps read on the host is what the binding plan of in-graph decisions sends there
    plan = plan_for(rt.manifest, "cuda", cfg.exits, cfg.signal, cfg.policy, chain=True)
    L = rt.manifest.num_layers
    for r, g in zip(singles, alone, strict=True):
        assert len(r.step_reads) == len(g.exit_layers)
        for reads, layer in list(zip(r.step_reads, g.exit_layers, strict=True))[1:]:  # after the prompt's step
            want = sorted(
                (c.graph, c.at, b.key)
                for c in plan.token(None if layer == L else layer)
                for b in c.bindings
                if b.host_read
            )
            assert sorted(reads) == want, (source, layer)


def test_signals_one_formula_for_tensors_and_arrays():
    """The runner scores numpy arrays and calibrate torch tensors through the same numpy formula; both equal a
    torch softmax's top-1 probability, top-1 - top-2 margin and top-1 id (ties included: margin 0)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 64, generator=g) * 3
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie at the top
    cand = torch.randint(0, 1000, (7, 64), generator=g)
    probs = torch.softmax(logits, -1)
    top2 = torch.topk(probs, 2, -1)
    from_tensors, from_arrays = signals(logits, cand), signals(logits.numpy(), cand.numpy())
    assert isinstance(from_tensors.prob, torch.Tensor) and isinstance(from_arrays.prob, np.ndarray)
    for s in (from_tensors, from_arrays):
        assert np.allclose(np.asarray(s.prob), top2.values[:, 0].numpy(), atol=1e-6)
        assert np.allclose(np.asarray(s.margin), (top2.values[:, 0] - top2.values[:, 1]).numpy(), atol=1e-6)
        assert np.asarray(s.token)[3] == cand[3, 10] and float(np.asarray(s.margin)[3]) == 0.0
        rows = [r for r in range(7) if r != 3]
        assert np.array_equal(np.asarray(s.token)[rows], cand[rows].gather(1, top2.indices[rows, :1])[:, 0].numpy())
    assert np.array_equal(from_tensors.prob.numpy(), from_arrays.prob)  # bit for bit: one code path
    passed = passes({"prob": from_arrays.prob}, {"prob": 0.5})
    assert passed.dtype == bool and np.array_equal(passed, from_arrays.prob >= 0.5)


@pytest.mark.parametrize("source", SOURCES)
def test_kept_exit_bindings_equal_fresh_ones_call_after_call(planned, source):
    """The exit graphs' bindings are kept and their buffers reused: calls with changing inputs (rows, K, layers
    interleaved) must equal calls on fresh bindings bit for bit, and a result kept by a caller must not change."""
    rt = planned[source]
    fresh = ArtifactRuntime(rt.folder, provider="cpu")
    g = torch.Generator().manual_seed(11)
    H = rt.manifest.dims["hidden_size"]
    kept: list[tuple[np.ndarray, ...]] = []
    for step in range(8):
        hidden = (torch.randn(1 + step % 3, H, generator=g) * 4).numpy()
        k, layer, later = (K, 2, 3) if step % 2 else (4, 3, 4)
        fresh._bounds.clear()
        want_c, want_cl = fresh.exit_candidates(layer, hidden, k)
        fresh._bounds.clear()
        want_local = fresh.exit_local(later, hidden, want_c)
        fresh._bounds.clear()
        want_full = fresh.exit_full(layer, hidden, k)
        got_c, got_cl = rt.exit_candidates(layer, hidden, k)
        got_local = rt.exit_local(later, hidden, got_c)
        got_full = rt.exit_full(layer, hidden, k)
        pairs = zip((got_c, got_cl, got_local, *got_full), (want_c, want_cl, want_local, *want_full), strict=True)
        for got, want in pairs:
            np.testing.assert_array_equal(got, want)
        kept.append((got_c.copy(), got_c, got_local.copy(), got_local))
    for snapshot, returned, local_snapshot, local in kept:  # later calls wrote nothing into earlier results
        np.testing.assert_array_equal(returned, snapshot)
        np.testing.assert_array_equal(local, local_snapshot)


@pytest.mark.parametrize("source", SOURCES)
def test_candidate_graph_decisions_equal_the_signals(planned, source):
    """The candidate graphs decide in-graph as exits.signals does on their candidates (tests/test_exit_decision)."""
    from tests.test_exit_decision import _check, _hidden

    rt = planned[source]
    assert _check(rt, rt.candidate_graphs[2], _hidden(rt), k=K) > 100


def test_run_json_gives_the_plan_as_fields_and_cost_samples_only_when_asked(planned):
    import json

    from typer.testing import CliRunner

    from eectl.cli import app
    from eectl.plan.length import plan_for_run

    rt = planned["int8"]
    m = rt.manifest
    assert m.plan is not None and m.costs is not None and m.costs.samples_ms
    args = ["run", str(rt.folder), "hello", "-n", "3", "--json", "--threads", "1"]
    res = CliRunner().invoke(app, [*args, "--policy", "verify"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    plan = doc["plan"]
    priced = plan_for_run(m, 3)  # the plan priced for the run's 3 tokens (plan/length.py)
    assert priced is not None
    assert plan["default"] == priced.default and plan["followed"] is True and plan["summary"] == priced.summary()
    verify = priced.choices["verify"]
    if verify.exits:  # the prediction for what ran: verify's choice
        assert plan["predicted_speedup"] == verify.prediction.speedup and doc["exits"] == verify.exits
    else:
        assert plan["predicted_speedup"] is None and doc["exits"] == []
    assert doc["note"].startswith("plan:") and "samples_ms" not in doc["costs"] and doc["costs"]["segment_ms"]
    explicit = json.loads(CliRunner().invoke(app, [*args, "--exits", "3", "--thresholds", "0.5"]).stdout)
    assert explicit["plan"]["followed"] is False and explicit["plan"]["predicted_speedup"] is None
    full = json.loads(CliRunner().invoke(app, [*args, "--cost-samples"]).stdout)
    assert full["costs"]["samples_ms"] == m.costs.samples_ms
    # the console summary: the decode speed against the artifact's own measured full-depth step
    text = CliRunner().invoke(app, ["run", str(rt.folder), "hello", "-n", "3", "--threads", "1"])
    assert text.exit_code == 0 and f"{m.costs.baseline_ms():.1f} ms/token)" in text.stderr, text.stderr
    assert "x the artifact's measured full depth" in text.stderr
