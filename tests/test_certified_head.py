"""The certified final head (export/certified_head.py): a token it passes is the full head's argmax, and decode with
it equals decode without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eectl.export.certified_head import certifiable
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.models.loading import load_model
from eectl.runtime.certified_bound import BLOCK, check_kernel, quantize_blocks
from eectl.runtime.certified_head import CertifiedHead
from eectl.runtime.chain import DecodeChain
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig


def _prompts(vocab: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (3 + 2 * i,), generator=g).tolist() for i in range(n)]


def _full_argmax(rt: ArtifactRuntime, states: np.ndarray) -> np.ndarray:
    g = rt.full_graphs[rt.manifest.num_layers]
    feeds = {g.name("hidden"): states, g.name("top_k"): np.array([1], np.int64), **rt.weight_feeds(g)}
    return g.session.run([g.name("token")], feeds)[0]


def _certified(rt: ArtifactRuntime, states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    g = rt.certified_head
    assert g is not None
    feeds = {g.name("hidden"): states, **rt.weight_feeds(g)}
    passed, token = g.session.run([g.name("passed"), g.name("token")], feeds)
    return passed, token


def test_only_heads_the_certificate_covers_get_one(exported):
    """Float32 artifacts whose final head is the shared table get the graph; a soft-capped head does not (a capped
    logit can tie where the raw ones do not), nor a float16 artifact or a quantized head."""
    for fam, (loaded, folder) in exported.items():
        rt = ArtifactRuntime(folder, provider="cpu")
        why = certifiable(loaded.adapter, "fp32", "fp32")
        assert (rt.certified_head is None) == (why is not None), fam
        assert certifiable(loaded.adapter, "fp16", "fp32") is not None
        assert certifiable(loaded.adapter, "fp32", "int4") is not None
    gemma = exported["gemma3_text"][0].adapter
    assert "soft-capped" in (certifiable(gemma, "fp32", "fp32") or "")


def test_the_bound_covers_the_8bit_scores(llama):
    """The tables' bound holds for the dequantized weights in exact arithmetic: |h.w - h~.w~| <= the bound, with h~
    any activations within half a step of h (the kernel's rounding), on states of every scale."""
    w = llama.adapter.lm_head.weight.detach().double()
    t = quantize_blocks(llama.adapter.lm_head.weight.detach().numpy())
    V, H = w.shape
    nb = H // BLOCK
    deq = (t["q"].astype(np.float64) - t["zero_points"].reshape(V, nb, 1)) * t["scales"].reshape(V, nb, 1)
    deq_t = torch.from_numpy(deq.reshape(V, H))
    bound = torch.from_numpy(t["bound"].astype(np.float64)).T  # [2 nb, V]
    assert (t["bound_max"] >= t["bound"]).all()
    g = torch.Generator().manual_seed(3)
    for scale in (0.01, 1.0, 40.0):
        h = torch.randn(64, H, generator=g, dtype=torch.float64) * scale
        h[:, 5] *= 30  # an outlier dimension, as real states have
        blocks = h.abs().reshape(-1, nb, BLOCK)
        step = blocks.amax(2) / 127
        # the worst activations the kernel may use: each off by half a step, against the sign of its weight
        q = torch.round(h.reshape(-1, nb, BLOCK) / step[..., None]) * step[..., None]
        h_q = q.reshape(-1, H)
        err = (h @ w.T - h_q @ deq_t.T).abs()
        limit = torch.cat([blocks.sum(2), step], 1) @ bound
        assert bool((err <= limit).all()), scale
        live = limit > 0  # (a zero row, the tiny model's padding token's, has no error and no bound)
        assert float((err[live] / limit[live]).max()) > 0.01  # the bound is not vacuous for these states


def test_a_passed_token_is_the_full_heads_argmax(exported):
    """On states of the model's own segments and random ones, every token the certified head passes equals the full
    head's argmax; it passes most states here, so the check is not vacuous."""
    for fam, (loaded, folder) in exported.items():
        rt = ArtifactRuntime(folder, provider="cpu")
        if rt.certified_head is None:
            continue
        H = loaded.adapter.dims.hidden_size
        g = np.random.default_rng(4)
        states = g.standard_normal((400, H)).astype(np.float32) * np.float32(g.uniform(0.1, 8.0, (400, 1)))
        passed, token = _certified(rt, states)
        full = _full_argmax(rt, states)
        assert (token[passed] == full[passed]).all(), fam
        assert passed.mean() > 0.5, (fam, passed.mean())


def test_ties_are_not_passed(tiny_dirs, tmp_path):
    """A model whose LM head has two equal rows ties them at every state where they lead: the certificate refuses
    exactly those states (the full head takes the first index) and passes others."""
    loaded = load_model(str(tiny_dirs["mistral"]))
    w = loaded.adapter.lm_head.weight
    H = loaded.adapter.dims.hidden_size
    states = np.random.default_rng(8).standard_normal((300, H)).astype(np.float32)
    with torch.no_grad():
        lead = (torch.from_numpy(states) @ w.T).argmax(1)
        a = int(torch.bincount(lead).argmax())
        w[(a + 1) % w.shape[0]] = w[a]
    export_artifact(loaded, tmp_path / "a", ExportOptions(exits=[2], top_k=8, validate=False, profile_costs=False))
    rt = ArtifactRuntime(tmp_path / "a", provider="cpu")
    g = rt.full_graphs[rt.manifest.num_layers]
    feeds = {g.name("hidden"): states, g.name("top_k"): np.array([2], np.int64), **rt.weight_feeds(g)}
    top = g.session.run([g.name("candidate_logits")], feeds)[0]
    tie = top[:, 0] == top[:, 1]
    passed, token = _certified(rt, states)
    assert tie.any() and not passed[tie].any()
    assert passed[~tie].mean() > 0.5 and (token[passed] == _full_argmax(rt, states)[passed]).all()


@pytest.mark.parametrize("policy", [None, "defer"])
def test_decode_with_the_certified_head_equals_decode_without(exported, policy, monkeypatch):
    """Greedy decode on the bound chain (one row, a batch of rows in slots, and one row with exits) gives the same
    tokens and exit layers with the certified head as with the full head every step, on every family; the certified
    head did take steps where the artifact has one."""
    chains: list[DecodeChain] = []
    made = DecodeChain.__init__

    def spy(self, *a, **k):
        made(self, *a, **k)
        chains.append(self)

    monkeypatch.setattr(DecodeChain, "__init__", spy)
    for fam, (loaded, folder) in exported.items():
        rt = ArtifactRuntime(folder, provider="cpu")
        prompts = _prompts(loaded.adapter.dims.vocab_size, 3)
        runs = {}
        for on in (True, False):
            exits = [2] if policy else []
            cfg = RunConfig(
                exits=exits,
                thresholds={e: {"prob": 0.6} for e in exits},
                policy=policy or "defer",
                top_k=8,
                max_new_tokens=10,
                certified_head=on,
            )
            chains.clear()
            one = [(g.token_ids, g.exit_layers) for p in prompts for g in Runner(rt, cfg).generate([p])]
            batch = [(g.token_ids, g.exit_layers) for g in Runner(rt, cfg).generate(prompts, slots=3)]
            runs[on] = (one, batch, sum(c.certified.steps[0] for c in chains if c.certified is not None))
        assert runs[True][:2] == runs[False][:2], fam
        if rt.certified_head is not None:
            assert runs[True][2] > 0, fam


def test_a_certified_step_reads_its_flag_then_a_token(exported):
    """Each greedy step on the chain reads the certified head's `passed` flag, then either its token or, where it did
    not pass, the full head's: nothing else (the run's record of host reads, runtime/placement.py)."""
    loaded, folder = exported["qwen2"]
    rt = ArtifactRuntime(folder, provider="cpu")
    assert rt.certified_head is not None
    runner = Runner(rt, RunConfig(exits=[], thresholds={}, max_new_tokens=8))
    gen = runner.generate([_prompts(loaded.adapter.dims.vocab_size, 1)[0]])[0]
    L = rt.manifest.num_layers
    passed, token = ("head_certified", L, "passed"), ("head_certified", L, "token")
    assert len(runner.step_reads) == len(gen.token_ids) == 8
    assert all(reads in ([passed, token], [passed, ("exit_full", L, "token")]) for reads in runner.step_reads)
    assert any(reads == [passed, token] for reads in runner.step_reads)


class _MissingRow1:
    """A certified head's session whose row 1 never passes (the head's `passed` written after each run)."""

    def __init__(self, session, passed):
        self.session, self.passed = session, passed

    def run_with_iobinding(self, io):
        self.session.run_with_iobinding(io)
        self.passed[1] = False


def test_a_batch_runs_the_full_head_over_the_rows_the_certified_head_missed_alone(exported, monkeypatch):
    """A batch's step where the certified head proves some rows and not another (row 1, forced) gives every row its
    tokens alone and with the full head every step; the full head ran over the missed row alone (not the batch),
    and such a step read the certified flags, its tokens, then the full head's token."""
    loaded, folder = exported["qwen2"]
    rt = ArtifactRuntime(folder, provider="cpu")
    assert rt.certified_head is not None
    bind = CertifiedHead.bind.__func__

    def missing(cls, rt, hidden, rows):
        head = bind(cls, rt, hidden, rows)
        if head is not None and rows > 1:
            head.session = _MissingRow1(head.session, head.passed)
        return head

    monkeypatch.setattr(CertifiedHead, "bind", classmethod(missing))
    heads: list[int] = []
    greedy = ArtifactRuntime.greedy_token

    def spy(self, layer, hidden, *a, **k):
        heads.append(hidden.shape[0])
        return greedy(self, layer, hidden, *a, **k)

    monkeypatch.setattr(ArtifactRuntime, "greedy_token", spy)
    prompts = _prompts(loaded.adapter.dims.vocab_size, 3)
    cfg = RunConfig(exits=[], thresholds={}, max_new_tokens=8)
    runner = Runner(rt, cfg)
    batch = [g.token_ids for g in runner.generate(prompts, slots=3)]
    assert heads and set(heads) == {1}  # every step: row 1 alone
    L = rt.manifest.num_layers
    reads = [("head_certified", L, "passed"), ("head_certified", L, "token"), ("exit_full", L, "token")]
    assert reads in runner.step_reads
    full = Runner(rt, RunConfig(exits=[], thresholds={}, max_new_tokens=8, certified_head=False))
    assert batch == [g.token_ids for g in full.generate(prompts, slots=3)]
    assert batch == [g.token_ids for p in prompts for g in Runner(rt, cfg).generate([p])]


@pytest.mark.parametrize("how", ["lookup", "exits"])
def test_verifys_checks_use_it_with_the_same_tokens(exported, how, monkeypatch):
    """Verify's checks of several positions at once (drafts from the context; drafts from exits, every decode token
    one) take the certified head's tokens where every position passes: the same tokens as the full head every step,
    on every family, and the certified head did answer some of those checks, several positions in one call."""
    from eectl.runtime.certified_head import CertifiedHead

    answered: list[int] = []
    real = CertifiedHead.run

    def counting(self, place, rows=slice(None)):
        ok = real(self, place, rows)
        answered.append(len(self.passed) if ok else 0)
        return ok

    monkeypatch.setattr(CertifiedHead, "run", counting)
    for fam, (_, folder) in exported.items():
        rt = ArtifactRuntime(folder, provider="cpu")
        prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # repeats: drafts from the context find matches
        runs = {}
        for on in (True, False):
            exits = [] if how == "lookup" else [2, 4]
            drafts = 4 if how == "lookup" else 0
            cfg = RunConfig(
                exits=exits,
                thresholds={e: {"prob": 0.0} for e in exits},
                policy="verify",
                prompt_drafts=drafts,
                top_k=8,
                max_new_tokens=12,
                certified_head=on,
            )
            answered.clear()
            gens = Runner(rt, cfg).generate([prompt])
            assert how == "lookup" or gens[0].drafted > 0, fam
            runs[on] = ([g.token_ids for g in gens], list(answered))
        assert runs[True][0] == runs[False][0], fam
        assert not runs[False][1]
        if rt.certified_head is not None:
            assert sum(runs[True][1]) > 0, fam
            assert max(runs[True][1]) > 1, fam  # a check of several positions answered in one call


def test_the_kernel_check_passes_here_and_fails_against_a_tighter_bound():
    """The check at load (runtime/certified_bound.py) runs ORT's 8-bit kernel on random weights and activations and
    compares every score with the exact product: within the bound on this machine, and outside a bound 4x tighter
    (ORT 1.31's x86 kernel reaches ~0.4 of it on the probe), so the check can fail."""
    from eectl.runtime.ort import session_options

    assert check_kernel(64, session_options(None)) is None
    why = check_kernel(64, session_options(None), tighten=4.0)
    assert why is not None and "x the certified head's bound" in why
    assert check_kernel(64, session_options(None)) is None  # a tightened check is not what the runtime remembers


def test_a_machine_whose_kernel_fails_the_check_runs_the_full_head(exported, monkeypatch):
    """Where the kernel check fails, the runtime leaves the certified head out (the full head every step: the same
    tokens), says why, and `eectl run` warns."""
    from eectl.run.generate import RunOptions, open_runner
    from eectl.runtime import sessions

    loaded, folder = exported["qwen2"]
    prompt = _prompts(loaded.adapter.dims.vocab_size, 1)[0]
    cfg = RunConfig(exits=[], thresholds={}, max_new_tokens=8)
    good = ArtifactRuntime(folder, provider="cpu")
    assert good.certified_head is not None and good.certified_refused is None
    want = Runner(good, cfg).generate([prompt])[0].token_ids
    monkeypatch.setattr(sessions, "check_kernel", lambda *a, **k: "its 8-bit kernel's error reached 1.30x the bound")
    rt = ArtifactRuntime(folder, provider="cpu")
    assert rt.certified_head is None and rt.certified_refused == "its 8-bit kernel's error reached 1.30x the bound"
    runner = Runner(rt, cfg)
    assert runner.generate([prompt])[0].token_ids == want
    L = rt.manifest.num_layers
    assert all(reads == [("exit_full", L, "token")] for reads in runner.step_reads)  # the full head every step
    warned: list[str] = []
    open_runner(folder, RunOptions(exits="none", max_new_tokens=4), warn=warned.append)
    assert any("certified final head is off on this machine" in w and "1.30x" in w for w in warned)
