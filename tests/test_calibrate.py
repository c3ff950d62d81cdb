"""Calibrate on tiny models: the sequential rule replayed by brute force, signals equal to eectl.exits.signals, the
Clopper-Pearson bound against known values, the held-out report, calibration.json round trips, CLI behaviour."""

from __future__ import annotations

import copy
import json
import math
import sys
import types

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from eectl.calibrate.calibrator import CalibrateOptions, calibrate_model
from eectl.calibrate.fit import evaluate, fit
from eectl.cli import app
from eectl.contracts.calibration import Calibration, read_calibration, write_calibration
from eectl.data import encode_prompt, token_chunks
from eectl.errors import ArtifactError, DataError, UsageError
from eectl.exits.base import ExitHead, signals, topk_candidates, transition_cosine
from eectl.exits.generation import prompt_ids
from eectl.exits.measure import SOURCES, ExitScorer, Measurements, measure_generation, measure_text
from eectl.exits.thresholds import (
    betainc,
    binomial_upper_tail,
    clopper_pearson_lower,
    min_tokens_for,
    threshold_for_precision,
    threshold_with_bound,
)
from eectl.plan.choose import sequence_agreement
from tests.tiny import GSM8K

runner = CliRunner()
EXITS = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def measured(llama, gsm8k) -> Measurements:
    """About 900 teacher-forced and 300 generated tokens on every layer of the tiny llama, topk-prob, K=16."""
    scorer = ExitScorer(llama.adapter, EXITS, "topk-prob", 16)
    text = measure_text(scorer, token_chunks(llama.tokenizer, gsm8k, 900, 128), skip_first=1)
    prompts = prompt_ids(llama.tokenizer, gsm8k.prompts[:40], 200)
    gen, used = measure_generation(scorer, prompts, 300, 12, llama.tokenizer.eos_token_id, batch_size=4)
    # the first ceil(300 / 12) prompts (no row of the tiny model meets EOS within 12 tokens)
    assert text is not None and gen is not None and gen.n == 300 and used == 25
    return Measurements.concat([text, gen])


# --- Clopper-Pearson ---------------------------------------------------------------------------------------------


def test_clopper_pearson_known_values():
    # no failures in n trials: the one-sided lower bound is alpha^(1/n)
    for n in (1, 10, 299, 1000):
        assert float(clopper_pearson_lower(n, n, 0.95)) == pytest.approx(0.05 ** (1 / n), rel=1e-12)
    assert float(clopper_pearson_lower(0, 10, 0.95)) == 0.0
    # reference values: the alpha quantile of Beta(k, n - k + 1), computed with mpmath at 80 bits
    known = [(8, 10, 0.493098698937), (95, 100, 0.897746622357), (990, 1000, 0.983096824879), (1, 2, 0.0253205655191)]
    got = clopper_pearson_lower(torch.tensor([k for k, _, _ in known]), torch.tensor([n for _, n, _ in known]), 0.95)
    torch.testing.assert_close(got, torch.tensor([v for _, _, v in known], dtype=torch.float64), atol=1e-10, rtol=0)
    # the defining identity: P(X >= k | n, bound) = 1 - confidence, by the exact binomial sum
    k, n = 37, 50
    p = float(clopper_pearson_lower(k, n, 0.9))
    tail = sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(k, n + 1))
    assert tail == pytest.approx(0.1, abs=1e-9)
    assert min_tokens_for(0.99, 0.95) == 299 and min_tokens_for(0.95, 0.95) == 59
    # min_tokens_for(target, confidence) is the smallest all-correct count whose bound reaches the target
    for target, conf in ((0.99, 0.95), (0.95, 0.95), (0.995, 0.9), (0.9, 0.99)):
        n = min_tokens_for(target, conf)
        assert float(clopper_pearson_lower(n, n, conf)) >= target > float(clopper_pearson_lower(n - 1, n - 1, conf))


def test_betainc_matches_binomial_sums():
    for k, n, p in [(3, 7, 0.5), (2, 201, 0.01), (10, 10, 0.9), (480, 500, 0.95), (9900, 10000, 0.99)]:
        exact = math.fsum(
            math.exp(
                math.lgamma(n + 1)
                - math.lgamma(j + 1)
                - math.lgamma(n - j + 1)
                + j * math.log(p)
                + (n - j) * math.log1p(-p)
            )
            for j in range(k, n + 1)
        )
        assert float(binomial_upper_tail(k, n, p)) == pytest.approx(exact, rel=1e-8)
    assert float(betainc(2.0, 3.0, 0.0)) == 0.0 and float(betainc(2.0, 3.0, 1.0)) == 1.0
    # I_x(1, 1) = x; I_x(a, 1) = x^a
    x = torch.linspace(0.05, 0.95, 7, dtype=torch.float64)
    torch.testing.assert_close(betainc(1.0, 1.0, x), x)
    torch.testing.assert_close(betainc(3.5, 1.0, x), x**3.5)


def test_threshold_with_bound_is_the_lowest_qualifying_threshold():
    torch.manual_seed(0)
    conf = torch.rand(400)
    correct = torch.rand(400) < conf**0.1  # confident tokens are mostly right
    target, level = 0.9, 0.9
    got = threshold_with_bound(conf, correct, target, level)
    # brute force over every distinct threshold (bounds computed in one vectorized call)
    ts = conf.unique()
    sel = conf[None, :] >= ts[:, None]  # [thresholds, tokens]
    ks, ns = (sel & correct[None, :]).sum(1), sel.sum(1)
    ok = clopper_pearson_lower(ks, ns, level) >= target
    best = float(ts[ok].min()) if bool(ok.any()) else float("inf")
    assert math.isfinite(best) and got.threshold == pytest.approx(best)
    assert got.threshold > threshold_for_precision(conf, correct, target).threshold  # the bound costs coverage
    none = threshold_with_bound(conf[:10], correct[:10], target, level)  # 10 tokens cannot carry the bound
    assert math.isinf(none.threshold)


# --- signals -----------------------------------------------------------------------------------------------------


def _states(adapter, ids):
    ins, outs = [], []
    adapter.forward_layers(
        adapter.embed(ids),
        torch.arange(ids.shape[1])[None],
        0,
        adapter.num_layers,
        on_layer=lambda i, a, b: (ins.append(a[0]), outs.append(b[0])),
    )
    return ins, outs


@torch.no_grad()
def test_topk_signals_are_exit_head_full_then_local(llama, gsm8k):
    adapter = llama.adapter
    torch.manual_seed(1)
    head = nn.Linear(64, 64)
    nn.init.eye_(head.weight)
    head.weight.add_(0.05 * torch.randn(64, 64))
    heads = {3: head}
    exits = [2, 3, 5]
    ids = token_chunks(llama.tokenizer, gsm8k, 60, 61)[0]
    ins, outs = _states(adapter, ids)
    states = [outs[e - 1] for e in exits]
    scorer = ExitScorer(adapter, exits, "topk-prob+margin", 8, heads)
    values, correct, final_top = scorer.score(states, None, outs[-1])
    # by hand: ExitHead.full at the first exit picks the candidates, ExitHead.local scores them later
    first = ExitHead(adapter)
    full = first.full(states[0])
    cand = topk_candidates(full, 8)
    expect = [signals(full.gather(-1, cand), cand)]
    expect += [
        signals(ExitHead(adapter, heads.get(e)).local(h, cand), cand)
        for e, h in zip(exits[1:], states[1:], strict=True)
    ]
    # the first exit's gathered full logits are its local logits
    local0 = signals(first.local(states[0], cand), cand)
    torch.testing.assert_close(local0.prob, expect[0].prob, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values["prob"], torch.stack([s.prob for s in expect]))
    torch.testing.assert_close(values["margin"], torch.stack([s.margin for s in expect]))
    assert torch.equal(final_top, adapter.logits(outs[-1]).argmax(-1))
    assert torch.equal(correct, torch.stack([s.token == final_top for s in expect]))
    # the head changes exit 3's prediction relative to the plain logit lens
    plain = signals(ExitHead(adapter).local(states[1], cand), cand)
    assert not torch.allclose(plain.prob, values["prob"][1])

    full_scorer = ExitScorer(adapter, exits, "full-prob", 8)
    values, correct, _ = full_scorer.score(states, None, outs[-1])
    want = [signals(ExitHead(adapter).full(h)) for h in states]
    torch.testing.assert_close(values["prob"], torch.stack([s.prob for s in want]))
    assert torch.equal(correct, torch.stack([s.token == final_top for s in want]))

    cos_scorer = ExitScorer(adapter, exits, "cosine", 8)
    values, correct, _ = cos_scorer.score(states, [ins[e - 1] for e in exits], outs[-1])
    torch.testing.assert_close(
        values["cosine"], torch.stack([transition_cosine(ins[e - 1], outs[e - 1]) for e in exits])
    )
    assert torch.equal(correct, torch.stack([s.token == final_top for s in want]))


@torch.no_grad()
def test_batched_generation_equals_one_prompt_at_a_time(llama, gsm8k):
    scorer = ExitScorer(llama.adapter, [2, 4], "topk-prob", 16)
    prompts = prompt_ids(llama.tokenizer, gsm8k.prompts[:5], 200)
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    a, used_a = measure_generation(scorer, prompts, 50, 10, None, batch_size=5)
    b, used_b = measure_generation(scorer, prompts, 50, 10, None, batch_size=1)
    assert a is not None and b is not None and a.n == b.n == 50 and used_a == used_b == 5
    # batches are sorted by prompt length within windows: order both prompt-major (steps stay in order)
    oa, ob = torch.argsort(a.unit, stable=True), torch.argsort(b.unit, stable=True)
    assert torch.equal(a.unit[oa], b.unit[ob]) and torch.equal(a.unit[oa], torch.arange(5).repeat_interleave(10))
    torch.testing.assert_close(a.values["prob"][:, oa], b.values["prob"][:, ob], atol=1e-4, rtol=1e-4)
    assert torch.equal(a.correct[:, oa], b.correct[:, ob])
    # the prompts are the data's, last record first, encoded as the runner encodes them
    assert prompts[0] == llama.tokenizer(gsm8k.prompts[4], add_special_tokens=True)["input_ids"]


def test_prompts_use_the_chat_template_unless_raw(llama):
    tok = copy.deepcopy(llama.tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>{% endif %}"
    )
    plain = tok("How many clips?", add_special_tokens=False)["input_ids"]
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert encode_prompt(tok, "How many clips?") == [bos, *plain, eos, bos]
    assert encode_prompt(tok, "How many clips?", raw=True) == tok("How many clips?")["input_ids"]
    # last record first, each cut to its last max_len tokens
    want = [encode_prompt(tok, "How many clips?")[-3:], encode_prompt(tok, "a b c d e f")[-3:]]
    assert prompt_ids(tok, ["a b c d e f", "How many clips?"], 3) == want and want[0] == [plain[-1], eos, bos]


# --- the sequential rule -----------------------------------------------------------------------------------------


def _replay(meas: Measurements, exits, mask):
    """Token by token: the first exit whose every threshold passes takes the token."""
    per_exit = [{"reached": 0, "exited": 0, "hits": 0} for _ in exits]
    layers, remaining = [], [[] for _ in exits]
    for n in torch.nonzero(mask).flatten().tolist():
        taken = None
        for e, x in enumerate(exits):
            per_exit[e]["reached"] += 1
            remaining[e].append(n)
            thr = x.thresholds
            if all(v is not None and float(meas.values[c][e, n]) >= v for c, v in thr.items()):
                per_exit[e]["exited"] += 1
                per_exit[e]["hits"] += int(meas.correct[e, n])
                taken = x.layer
                break
        layers.append(meas.num_layers if taken is None else taken)
    return per_exit, layers, remaining


@pytest.mark.parametrize("target", [0.3, 0.6])
def test_sequential_thresholds_replayed_by_brute_force(measured, target):
    res = fit(measured, target, holdout=0.2)
    active = [x for x in res.exits if x.calibration.exited]
    assert len(active) >= 2, [x.thresholds for x in res.exits]  # the test needs several exits that take tokens
    held = measured.heldout_mask(0.2)
    for mask, stats, overall in (
        (~held, [x.calibration for x in res.exits], res.calibration),
        (held, [x.heldout for x in res.exits], res.heldout),
    ):
        counts, layers, remaining = _replay(measured, res.exits, mask)
        n = int(mask.sum())
        for c, s in zip(counts, stats, strict=True):
            assert s is not None and (s.reached, s.exited) == (c["reached"], c["exited"])
            assert s.coverage == pytest.approx(c["exited"] / n)
            assert s.precision == (c["hits"] / c["exited"] if c["exited"] else None)
        assert overall is not None and overall.tokens == n
        assert overall.mean_layers == pytest.approx(sum(layers) / n)
        assert overall.speedup_bound == pytest.approx(measured.num_layers * n / sum(layers))
        if mask is not held:
            # each exit meets the target on the calibration tokens it takes ...
            assert all(s.precision is None or s.precision >= target for s in stats)
            # ... and its threshold is FlexEE's lambda* on exactly the tokens that reach it (no earlier exit took)
            for e, x in enumerate(res.exits):
                idx = torch.tensor(remaining[e], dtype=torch.long)
                want = threshold_for_precision(measured.values["prob"][e, idx], measured.correct[e, idx], target)
                got = x.thresholds["prob"]
                assert (got is None and math.isinf(want.threshold)) or got == want.threshold
    # later exits see fewer tokens than the first one
    assert res.exits[-1].calibration.reached < res.exits[0].calibration.reached


def test_prob_and_margin_covers_at_least_prob_alone(llama, gsm8k):
    scorer = ExitScorer(llama.adapter, [3, 5], "topk-prob+margin", 16)
    meas = measure_text(scorer, token_chunks(llama.tokenizer, gsm8k, 600, 128))
    assert meas is not None
    both = fit(meas, 0.4, holdout=0.0)
    assert both.heldout is None and set(both.exits[0].thresholds) == {"prob", "margin"}
    prob_only = threshold_for_precision(meas.values["prob"][0], meas.correct[0], 0.4)
    assert both.exits[0].calibration.coverage >= prob_only.coverage > 0
    counts, _, _ = _replay(meas, both.exits, torch.ones(meas.n, dtype=torch.bool))
    for c, x in zip(counts, both.exits, strict=True):
        assert c["exited"] == x.calibration.exited and (not c["exited"] or c["hits"] / c["exited"] >= 0.4)


def test_confidence_bounds_every_exit(measured):
    res = fit(measured, 0.5, confidence=0.9, holdout=0.2)
    taken = [x for x in res.exits if x.calibration.exited]
    assert taken, "no exit qualifies under the bound"
    for x in taken:
        assert x.calibration.lower_bound is not None and x.calibration.lower_bound >= 0.5
        assert x.calibration.precision is not None and x.calibration.precision >= x.calibration.lower_bound
    plain = fit(measured, 0.5, holdout=0.2)
    assert res.calibration.exit_rate <= plain.calibration.exit_rate
    with pytest.raises(DataError, match="too small for the requested guarantee"):
        fit(measured, 0.999, confidence=0.95, holdout=0.2)  # needs 2995 calibration tokens


def test_heldout_split_and_report(measured):
    held = measured.heldout_mask(0.2)
    for s in range(len(SOURCES)):
        units = measured.unit[measured.source == s].unique()
        held_units = measured.unit[(measured.source == s) & held].unique()
        # whole units, the last ones of each source, about a fifth of them
        assert held_units.numel() == round(0.2 * units.numel()) and torch.equal(
            held_units, units[-held_units.numel() :]
        )
    res = fit(measured, 0.4, holdout=0.2)
    per_exit, overall = evaluate(measured, res.thresholds, held)
    assert res.heldout == overall and [x.heldout for x in res.exits] == per_exit
    assert sum(s.tokens for s in res.heldout_by_source.values()) == overall.tokens == int(held.sum())
    assert set(res.heldout_by_source) == set(SOURCES)
    assert not measured.heldout_mask(0.0).any() and fit(measured, 0.4, holdout=0.0).heldout is None


# --- the stage, calibration.json ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def calibration(llama, gsm8k) -> Calibration:
    opts = CalibrateOptions(
        exits=[4, 2], signal="topk-prob", target=0.5, top_k=16, tokens=600, gen_tokens=10, gen_batch=8
    )
    return calibrate_model(llama, gsm8k, opts)


def test_calibrate_model_describes_what_it_did(calibration, llama):
    cal = calibration
    assert [x.layer for x in cal.exits] == [2, 4] and cal.candidates_layer == 2 and cal.top_k == 16
    d = cal.data
    assert d.tokens == 600 and (d.teacher_forced_tokens, d.generated_tokens) == (450, 150) and d.prompts_used == 15
    assert d.calibration_tokens + d.heldout_tokens == 600 and d.heldout_tokens > 0 and not d.chat_template
    assert cal.model.sha256 == llama.source.sha256 and cal.model.num_layers == 6 and cal.criteria == ["prob"]
    assert cal.heldout is not None and cal.seconds_per_10k_tokens > 0


def test_calibration_json_round_trips_and_rejects_bad_files(calibration, tmp_path):
    path = write_calibration(calibration, tmp_path / "sub" / "calibration.json")
    assert [p.name for p in path.parent.iterdir()] == ["calibration.json"]  # no temp file left behind
    back = read_calibration(path)
    assert back == calibration and back.to_dict() == json.loads(path.read_text())
    by_layer = back.thresholds_by_layer()
    assert set(by_layer) == {2, 4}
    on_disk = {x["layer"]: x["thresholds"]["prob"] for x in json.loads(path.read_text())["exits"]}
    for x in back.exits:  # inf in memory for an exit that never exits, null in the file; else the threshold
        assert by_layer[x.layer] == x.thresholds
        assert on_disk[x.layer] == (None if math.isinf(x.thresholds["prob"]) else x.thresholds["prob"])

    raw = json.loads(path.read_text())
    for edit, text in [
        (lambda r: r.update(schema_version=99), "schema_version 99"),
        (lambda r: r.pop("signal"), "signal"),
        (lambda r: r.update(signal="full-margin"), "criteria"),
        (lambda r: r["exits"][0].update(layer=6), "exits"),
        (lambda r: r["exits"][1]["thresholds"].update(margin=0.1), "thresholds"),
        (lambda r: r.update(target=1.5), "target"),
    ]:
        bad = json.loads(json.dumps(raw))
        edit(bad)
        p = tmp_path / "bad.json"
        p.write_text(json.dumps(bad))
        with pytest.raises(ArtifactError, match=text):
            read_calibration(p)
    (tmp_path / "text.json").write_text("not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        read_calibration(tmp_path / "text.json")
    with pytest.raises(ArtifactError, match="not found"):
        read_calibration(tmp_path / "missing.json")


def test_options_are_checked_before_any_work():
    ok = CalibrateOptions(exits=[2, 4])
    for bad, err in [
        (dict(target=0.0), UsageError),
        (dict(target=1.01), UsageError),
        (dict(target=1.0, confidence=0.9), UsageError),
        (dict(signal="entropy"), UsageError),
        (dict(exits=[]), UsageError),
        (dict(exits=[2, 2]), UsageError),
        (dict(top_k=1), UsageError),
        (dict(holdout=1.0), UsageError),
        (dict(gen_batch=0), UsageError),
        (dict(confidence=1.0), UsageError),
        (dict(tokens=200, confidence=0.95), DataError),
    ]:
        from eectl.calibrate.calibrator import check_options

        opts = CalibrateOptions(**{**ok.__dict__, **bad})
        with pytest.raises(err):
            check_options(opts, num_layers=6, vocab_size=384)
    from eectl.calibrate.calibrator import check_options

    with pytest.raises(UsageError, match="outside the model's layers 1..5"):
        check_options(CalibrateOptions(exits=[2, 6]), num_layers=6)
    with pytest.raises(UsageError, match="exceeds the vocabulary"):
        check_options(CalibrateOptions(exits=[2], top_k=500), num_layers=6, vocab_size=384)


# --- CLI ---------------------------------------------------------------------------------------------------------


def _cli(tiny_dirs, *args):
    return runner.invoke(
        app,
        ["calibrate", str(tiny_dirs["qwen2"]), "--data", str(GSM8K), "--threads", "1", "--top-k", "16", *args],
    )


def test_cli_calibrate_json(tiny_dirs, tmp_path):
    out = tmp_path / "c.json"
    res = _cli(tiny_dirs, "--tokens", "400", "--exits", "3,5", "--target", "0.5", "--out", str(out), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)  # stdout is exactly one JSON document: the file's content
    assert doc == json.loads(out.read_text()) and read_calibration(out).data.tokens == 400
    assert [x["layer"] for x in doc["exits"]] == [3, 5] and doc["signal"] == "topk-prob" and doc["threads"] == 1


def test_cli_calibrate_human_output_and_default_path(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = _cli(tiny_dirs, "--tokens", "300", "--target", "0.4", "--signal", "full-prob")
    assert res.exit_code == 0, res.output
    path = tmp_path / "artifacts" / "qwen2-calibration.json"
    assert path.is_file() and "held-out" in res.stdout and "speedup bound" in res.stdout and path.name in res.stdout
    cal = read_calibration(path)
    assert [x.layer for x in cal.exits] == [2, 3, 4, 5] and cal.top_k is None  # the recipe's default exits
    # the generated tokens' per-token disagreement, compounded over one continuation (what bench will see)
    gen, n = cal.heldout_by_source["generated"], cal.data.gen_tokens_per_prompt
    want = f"{n}-token continuations under copy/defer agree {sequence_agreement(1 - gen.agreement, n):.1%}"
    assert want in " ".join(res.stdout.split())


def test_cli_calibrate_says_how_its_menu_was_judged(tiny_dirs, tmp_path):
    out = tmp_path / "c.json"
    res = _cli(tiny_dirs, "--tokens", "300", "--target", "0.4", "--signal", "topk-prob", "--out", str(out))
    assert res.exit_code == 0, res.output
    cal = read_calibration(out)
    assert cal.options and cal.options_judged_on > 0
    assert f"{len(cal.options)} menu options, judged out of fold on {cal.options_judged_on} tokens" in " ".join(
        res.stdout.split()
    )


def test_cli_calibrate_with_heads(tiny_dirs, tmp_path, monkeypatch):
    """--heads goes through eectl.exits.designs.load_heads (faked here) and every exit with a head uses it."""
    seen = {}

    def load_heads(path, adapter):
        seen["path"] = str(path)
        torch.manual_seed(0)
        return types.SimpleNamespace(heads={3: nn.Linear(64, 64), 9: nn.Linear(64, 64)})

    monkeypatch.setitem(sys.modules, "eectl.exits.designs", types.SimpleNamespace(load_heads=load_heads))
    heads = tmp_path / "heads.safetensors"
    heads.write_bytes(b"fake heads")
    out = tmp_path / "c.json"
    res = _cli(
        tiny_dirs,
        "--tokens",
        "300",
        "--exits",
        "3,5",
        "--heads",
        str(heads),
        "--out",
        str(out),
        "--json",
        "--confidence",
        "0",
    )
    assert res.exit_code == 0, res.output
    cal = read_calibration(out)
    assert seen["path"] == str(heads) and cal.heads is not None and cal.heads.layers == [3, 9]
    assert [x.head for x in cal.exits] == [True, False] and len(cal.heads.sha256) == 64


@pytest.mark.parametrize(
    ("args", "code", "text"),
    [
        (["--target", "1.5"], 2, "--target"),
        (["--target", "0"], 2, "--target"),
        (["--exits", "0,3"], 2, "outside the model's layers"),
        (["--exits", "3,6"], 2, "outside the model's layers"),
        (["--exits", "a,b"], 2, "--exits"),
        (["--signal", "entropy"], 2, "--signal"),
        (["--top-k", "1"], 2, "--top-k"),
        (["--confidence", "0.95", "--target", "0.99"], 4, "too small for the requested guarantee"),
        (["--target", "1", "--confidence", "0.9"], 2, "--target 1"),
        (["--tokens", "10000000"], 4, "fewer than"),
        (["--heads", "/nonexistent/heads.safetensors"], 2, "heads not found"),
    ],
)
def test_cli_calibrate_bad_input(tiny_dirs, tmp_path, args, code, text):
    base = ["--tokens", "200", "--exits", "3"] if "--exits" not in args else ["--tokens", "200"]
    base += [] if "--confidence" in args else ["--confidence", "0"]  # 200 tokens carry no 95% guarantee
    res = _cli(tiny_dirs, *base, "--out", str(tmp_path / "c.json"), *args)
    assert res.exit_code == code, res.output
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and text in last and res.stdout == ""
    assert not (tmp_path / "c.json").exists()
