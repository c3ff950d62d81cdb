"""Exact wide passes (export --exact-wide): one-row calls run with one zero position after theirs through the whole
segment, so a segment called on several positions of a row computes each of them bit for bit as a one-position step
does. ONNX Runtime computes one position with other kernels than several: GroupQueryAttention everywhere, and
MatMulNBits at accuracy level 4 (int8 activations) on AVX2 CPUs, at level 0 on every CPU; int8 activations turn such
last-bit differences into other tokens. Padded, every MatMul runs on at least two rows and attention on at least two
positions, so verify's drafts and drafts from the context are checked losslessly, and the plan may use them.

Measured while building it (tests' tiny models, every family, widths 2-17 after 10-40 positions): int4 level 4
unpadded differed from one-position steps by 4e-7..1.1e-2, padded by 0.0, their K/V too, on an AVX-512 CPU and on
AVX2 (the same CPU emulated without AVX-512: `qemu-x86_64 -cpu max`, where padding attention alone left 1e-6..2e-6
from MatMulNBits' one-row kernel); fp32 graphs alike (5e-7..1.2e-6 unpadded, 0.0 padded). What a test's outcome
depends on (whether this CPU's MatMulNBits computes one row as it computes two: `_one_row_as_two`) is checked here at
run time, and both outcomes are tested on every CPU: accuracy level 0 computes one row differently everywhere."""

from __future__ import annotations

import numpy as np
import pytest

from eectl.contracts.manifest import read_manifest
from eectl.errors import UsageError
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.export.quantize import Int4Options
from eectl.models import load_model
from eectl.plan.choose import wide_inexact
from eectl.runtime.kv import new_kv
from eectl.runtime.rows import one_row_as_two, rows_padded
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from eectl.runtime.wide_check import check_wide
from tests.tiny import random_ids as _ids

EXITS = [2, 4]
K = 8
INT4 = Int4Options(min_agreement=0.3)  # tiny random models under int4: see tests/test_quantize.py


@pytest.fixture(scope="module")
def padded(tiny_dirs, tmp_path_factory):
    """family -> int4 level-4 artifact exported with padded one-row attention."""
    root = tmp_path_factory.mktemp("exact-wide")
    out = {}
    for fam, folder in tiny_dirs.items():
        opts = ExportOptions(exits=EXITS, top_k=K, weights="int4", int4=INT4, profile_costs=False, exact_wide=True)
        export_artifact(load_model(str(folder)), root / fam, opts)
        out[fam] = root / fam
    return out


@pytest.fixture(scope="module")
def padded_level0(tiny_dirs, tmp_path_factory):
    """A llama int4 artifact at accuracy level 0 (fp32 compute), padded: MatMulNBits' fp32 kernel computes one row
    otherwise than several on every CPU."""
    art = tmp_path_factory.mktemp("exact-wide-level0") / "llama"
    int4 = Int4Options(min_agreement=0.3, accuracy_level=0)
    opts = ExportOptions(exits=EXITS, top_k=K, weights="int4", int4=int4, profile_costs=False, exact_wide=True)
    export_artifact(load_model(str(tiny_dirs["llama"])), art, opts)
    return art


def _one_row_as_two(art) -> bool:
    return one_row_as_two(read_manifest(art))


def test_the_cpu_probe_sees_level_0_compute_one_row_otherwise(padded, padded_level0):
    """The probe the runtime and the tests below rest on: MatMulNBits at level 0 computes one row otherwise than two
    on every CPU (so the probe can say no, and a level-0 artifact pads rows everywhere); at level 4 its answer is this
    CPU's (AVX-512: yes, attention only; AVX2: no, rows)."""
    level0, level4 = read_manifest(padded_level0), read_manifest(padded["llama"])
    assert not one_row_as_two(level0) and rows_padded(level0)
    assert rows_padded(level4) is not one_row_as_two(level4)
    assert rows_padded(level4, asked=True) and not rows_padded(level4, asked=False)
    assert not rows_padded(read_manifest(padded["llama"]).model_copy(update={"kv": _kv(level4, pad_switch=None)}))


def _kv(m, **update):
    return m.kv.model_copy(update=update)


@pytest.mark.parametrize("pad_rows", [True, None])
def test_padding_runs_every_matmul_on_two_rows(padded_level0, pad_rows):
    """At accuracy level 0, where MatMulNBits computes one row otherwise than several on every CPU, a padded
    artifact's wide pass still equals its one-position steps bit for bit: the padding reaches the MatMuls, not only
    attention (padding attention alone left level 0 inexact), whether asked for or chosen by the runtime."""
    m = read_manifest(padded_level0)
    assert m.kv.pad == 1 and m.kv.pad_switch and m.quantization is not None and m.quantization.accuracy_level == 0
    assert m.validation["wide_exact"]["exact"]
    rt = ArtifactRuntime(padded_level0, provider="cpu", pad_rows=pad_rows)
    assert rt.pad_rows
    for width in (2, 8):
        got = check_wide(rt, _ids(13, 30 + width, m.dims["vocab_size"]), width=width)
        assert got["exact"] and got["max_abs_diff"] == 0.0, got


def test_attention_only_padding_is_exact_only_where_one_row_computes_as_two(padded, padded_level0):
    """Padding attention only (what the runtime chooses where this CPU computes one row as two) is exact exactly
    there: at level 4 as this CPU's probe says (AVX-512: exact; AVX2: not), at level 0 not on any CPU."""
    for art in (padded["llama"], padded_level0):
        m = read_manifest(art)
        rt = ArtifactRuntime(art, provider="cpu", pad_rows=False)
        got = check_wide(rt, _ids(14, 38, m.dims["vocab_size"]), width=8)
        assert got["exact"] is _one_row_as_two(art), (m.quantization, got)
        assert got["exact"] or 0.0 < got["max_abs_diff"] < 1.0


def test_the_runtime_pads_rows_as_told_by_the_environment(padded, monkeypatch):
    m = read_manifest(padded["llama"])
    for value, want in (("1", True), ("0", False), ("auto", not _one_row_as_two(padded["llama"]))):
        monkeypatch.setenv("EECTL_PAD_ROWS", value)
        assert rows_padded(m) is want
    monkeypatch.setenv("EECTL_PAD_ROWS", "yes")
    with pytest.raises(UsageError, match="EECTL_PAD_ROWS must be auto, 0 or 1"):
        rows_padded(m)


@pytest.fixture(scope="module")
def unpadded(tiny_dirs, tmp_path_factory):
    art = tmp_path_factory.mktemp("wide-unpadded") / "llama"
    opts = ExportOptions(exits=EXITS, top_k=K, weights="int4", int4=INT4, profile_costs=False, exact_wide=False)
    export_artifact(load_model(str(tiny_dirs["llama"])), art, opts)
    return art


def _run(rt, prompt, policy="verify", exits=(), drafts=0, new=32, slots=None, prompts=None):
    cfg = RunConfig(
        exits=list(exits),
        thresholds={e: {"prob": 0.0} for e in exits},  # every token an exit draft
        policy=policy,
        top_k=K,
        max_new_tokens=new,
        prompt_drafts=drafts,
    )
    runner = Runner(rt, cfg)
    out = runner.generate(prompts or [prompt], slots=slots)
    return out, runner.last_kv


def _cache(kv, row, n):
    return [np.asarray(b)[..., :n, :].copy() for layer in (kv.keys[row], kv.values[row]) for b in layer]


def test_export_pads_where_drafts_rest_on_it_unless_told(monkeypatch):
    """By default (auto) on for int4 segments at accuracy levels 2-4, whose drafts are lossless only so, off
    elsewhere; `--exact-wide` / `--no-exact-wide` decide instead."""
    from typer.testing import CliRunner

    from eectl.cli import app

    seen = []

    def fake(recipe, req, out):
        seen.append(req.options.exact_wide)
        raise SystemExit(3)

    monkeypatch.setattr("eectl.export.stage.export", fake)
    for flags, want in (([], None), (["--exact-wide"], True), (["--no-exact-wide"], False)):
        result = CliRunner().invoke(app, ["export", "--weights", "int4", *flags])
        assert result.exit_code == 3 and seen[-1] is want, result.output
    assert ExportOptions(exits=[]).exact_wide is None and not ExportOptions(exits=[]).pads()  # fp32
    assert ExportOptions(exits=[], weights="int4").pads()  # accuracy level 4
    assert not ExportOptions(exits=[], weights="int4", int4=Int4Options(accuracy_level=0)).pads()
    assert not ExportOptions(exits=[], weights="int4", exact_wide=False).pads()
    assert ExportOptions(exits=[], exact_wide=True).pads()


@pytest.mark.parametrize("pad_rows", [True, None])
def test_padded_int4_segments_compute_a_wide_pass_as_one_position_steps(padded, family, pad_rows):
    """Export records the padding and its check; the check, run again here on every segment (a 40-token prompt,
    then 8 positions in one call against 8 one-position calls), finds states and K/V equal bit for bit, with every
    MatMul's rows padded (exact on every CPU) and as the runtime chooses on this CPU (attention only where one row
    computes as two)."""
    m = read_manifest(padded[family])
    assert m.kv.pad == 1 and m.quantization is not None and m.quantization.accuracy_level == 4
    assert m.validation["wide_exact"]["exact"] and m.validation["wide_exact"]["max_abs_diff"] == 0.0
    assert wide_inexact(m) == ""
    rt = ArtifactRuntime(padded[family], provider="cpu", pad_rows=pad_rows)
    for width in (2, 8):
        got = check_wide(rt, _ids(3, 40 + width, m.dims["vocab_size"]), width=width)
        assert got == {"exact": True, "max_abs_diff": 0.0, "width": width, "prompt": 40}


def test_the_check_sees_a_wide_pass_that_differs(padded, monkeypatch):
    """One-position calls nudged by one part in 10^6 (as ORT's other kernels differ): the check reports it."""
    rt = ArtifactRuntime(padded["llama"], provider="cpu")
    run = ArtifactRuntime.run_segment

    def nudged(self, index, hidden, kv, row, *args, **kwargs):
        out = run(self, index, hidden, kv, row, *args, **kwargs)
        if hidden.shape[1] == 1:
            return (np.asarray(out[0]) * np.float32(1 + 1e-6), *out[1:])
        return out

    monkeypatch.setattr(ArtifactRuntime, "run_segment", nudged)
    got = check_wide(rt, _ids(4, 20, rt.manifest.dims["vocab_size"]), width=4)
    assert not got["exact"] and got["max_abs_diff"] > 0


def test_an_unpadded_int4_artifact_keeps_drafts_off(unpadded):
    m = read_manifest(unpadded)
    assert m.kv.pad == 0 and "wide_exact" in m.validation
    assert "--exact-wide" in wide_inexact(m)


def test_drafts_on_padded_int4_equal_full_depth_bit_for_bit(padded, family):
    """verify with every token an exit draft, and drafts from the context, on int4 level-4 segments: the tokens
    and every layer's K/V of full depth, exactly (a wide pass computes as the one-position steps would have)."""
    rt = ArtifactRuntime(padded[family], provider="cpu")
    V = rt.manifest.dims["vocab_size"]
    phrase = _ids(7, 6, V)
    for prompt in (phrase * 3 + _ids(8, 4, V), _ids(9, 14, V)):
        (want,), kv = _run(rt, prompt)
        n = len(prompt) + len(want.token_ids)
        cache = _cache(kv, 0, n - 1)  # the last token is emitted, never fed back
        for policy, exits, drafts in (("verify", EXITS, 0), ("verify", (), 6), ("verify", EXITS, 6)):
            (got,), kv2 = _run(rt, prompt, policy=policy, exits=exits, drafts=drafts)
            assert got.token_ids == want.token_ids, (family, policy, exits, drafts)
            assert got.drafted + got.rejected_drafts + got.prompt_drafted > 0  # wide passes checked drafts
            other = _cache(kv2, 0, n - 1)
            assert all(np.array_equal(a, b) for a, b in zip(cache, other, strict=True)), (family, exits, drafts)


def test_a_batch_on_padded_segments_runs_its_rows_unpadded(padded):
    """Several rows in one call (GQA takes one position per row there) run unpadded; a row's prompt (a one-row call,
    padded) gives the same first token as the prompt alone."""
    rt = ArtifactRuntime(padded["llama"], provider="cpu")
    V = rt.manifest.dims["vocab_size"]
    prompts = [_ids(s, 9 + s, V) for s in range(3)]
    alone = [_run(rt, p, new=8)[0][0].token_ids for p in prompts]
    batch, _ = _run(rt, None, new=8, slots=2, prompts=prompts)
    assert [g.token_ids[0] for g in batch] == [a[0] for a in alone]
    assert all(len(g.token_ids) == 8 for g in batch)


@pytest.mark.parametrize("level", [4, 0])
def test_a_call_with_no_free_slot_runs_unpadded(padded, padded_level0, level):
    """A buffer with no slot after the call's positions (an old runtime's, or a full cache): the graph does not pad
    and writes nothing out of bounds; the K/V it writes are those of a padded call where this CPU's MatMulNBits
    computes one row as two (level 4 on AVX-512), else within a last-bit distance of them (level 4 on AVX2, level 0
    everywhere), and every earlier position's are equal bit for bit."""
    rt = ArtifactRuntime(padded["llama"] if level == 4 else padded_level0, provider="cpu")
    m = rt.manifest
    tight = m.model_copy(update={"kv": m.kv.model_copy(update={"pad": 0})})
    ids = np.array([_ids(5, 12, m.dims["vocab_size"])], dtype=np.int64)
    caches = []
    for kv in (new_kv(tight, 1, 12, rt.np_dtype, "cpu"), rt.new_kv(1, 12)):
        x = np.asarray(rt.embed(ids))
        rt.run_segment(0, x[:, :11].copy(), kv, row=0)
        rt.run_segment(0, x[:, 11:].copy(), kv, row=0)  # positions 11: the last slot of the tight buffer
        caches.append(_cache(kv, 0, 12))
    assert np.asarray(caches[0][0]).shape[-2] == 12
    assert all(np.array_equal(a[..., :11, :], b[..., :11, :]) for a, b in zip(*caches, strict=True))
    if _one_row_as_two(padded["llama"] if level == 4 else padded_level0):
        assert all(np.array_equal(a, b) for a, b in zip(*caches, strict=True))
    else:
        assert all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(*caches, strict=True))


def test_the_machine_check_runs_once_per_process_and_artifact(padded, unpadded, monkeypatch):
    """`wide_refused` checks this machine's kernels where an artifact's drafts rest on padded attention (an int4
    level-4 artifact exported padded), once per process and artifact; not at all where nothing rests on it."""
    from eectl.runtime import wide_check

    monkeypatch.setattr(wide_check, "_REFUSED", {})
    calls = []
    real = wide_check.check_wide

    def counted(rt, ids, width=8):
        calls.append(len(ids))
        return real(rt, ids, width)

    monkeypatch.setattr(wide_check, "check_wide", counted)
    rt = ArtifactRuntime(padded["llama"], provider="cpu")
    assert wide_check.wide_refused(rt) is None and wide_check.wide_refused(rt) is None
    assert calls == [wide_check.CHECK_TOKENS]
    assert wide_check.wide_refused(ArtifactRuntime(unpadded, provider="cpu")) is None  # the plan already refuses it
    assert calls == [wide_check.CHECK_TOKENS]
    monkeypatch.setattr(wide_check, "_REFUSED", {})
    monkeypatch.setattr(wide_check, "check_wide", lambda rt, ids, width=8: {"exact": False, "max_abs_diff": 3e-7})
    assert "differs from one-position steps on this machine (by up to 3.0e-07)" in (wide_check.wide_refused(rt) or "")


def test_a_planned_default_that_is_inexact_here_runs_full_depth(padded, padded_level0, monkeypatch):
    """Where this machine's check fails, the plan's verify (priced as lossless) gives way to full depth with a note;
    verify asked for by name runs, with a warning. Inexact for real on every CPU: a level-0 artifact run with
    attention padded only (EECTL_PAD_ROWS=0), whose one-row MatMulNBits differ from two rows everywhere; and the same
    artifact as the runtime chooses to run it (rows padded) follows its plan."""
    from eectl.run import generate
    from eectl.run.generate import RunOptions, open_runner

    planned = RunConfig(exits=[2], thresholds={2: {"prob": 0.9}}, policy="verify", top_k=K, planned=True)
    monkeypatch.setattr(generate, "resolve_config", lambda rt, opts, stop: planned)
    monkeypatch.setenv("EECTL_PAD_ROWS", "0")
    notes, warnings = [], []
    _, _, config, _ = open_runner(padded_level0, RunOptions(), warn=warnings.append, note=notes.append)
    assert (config.policy, config.exits, config.prompt_drafts) == ("defer", [], 0)
    assert config.note.startswith("plan: full depth: a wide pass differs from one-position steps on this machine")
    assert warnings == []
    _, _, config, _ = open_runner(padded_level0, RunOptions(policy="verify"), warn=warnings.append)
    assert config.policy == "verify" and config.exits == [2]
    assert len(warnings) == 1 and warnings[0].startswith("this run's output may differ from full depth's: a wide")
    monkeypatch.setenv("EECTL_PAD_ROWS", "auto")
    _, _, config, _ = open_runner(padded_level0, RunOptions(), warn=warnings.append, note=notes.append)
    assert (config.policy, config.exits) == ("verify", [2]) and len(warnings) == 1


def test_the_check_is_not_fooled_by_nan_and_runs_on_the_host_only(padded, monkeypatch):
    from types import SimpleNamespace

    from eectl.runtime import wide_check

    rt = ArtifactRuntime(padded["llama"], provider="cpu")
    run = ArtifactRuntime.run_segment

    def poisoned(self, index, hidden, kv, row, *args, **kwargs):
        out = run(self, index, hidden, kv, row, *args, **kwargs)
        return (np.full_like(np.asarray(out[0]), np.nan), *out[1:]) if hidden.shape[1] == 1 else out

    monkeypatch.setattr(ArtifactRuntime, "run_segment", poisoned)
    got = check_wide(rt, _ids(4, 20, rt.manifest.dims["vocab_size"]), width=4)
    assert not got["exact"] and got["max_abs_diff"] == float("inf")
    on_gpu = SimpleNamespace(manifest=rt.manifest, device="cuda", folder=rt.folder)
    assert "CPU EP only" in (wide_check.wide_refused(on_gpu) or "")  # type: ignore[arg-type]


def test_a_ggufs_8_bit_tensors_are_probed_too(padded):
    """An artifact from a GGUF's own blocks holds its 5-, 6- and 8-bit tensors as 8-bit MatMulNBits (block 16 for
    Q6_K): the CPU probe asks those kernels too, not only the manifest's 4-bit setting."""
    from eectl.runtime import rows

    m = read_manifest(padded["llama"])
    assert m.quantization is not None
    q = m.quantization.model_copy(update={"source": "gguf", "gguf_types": {"Q4_K": 6, "Q6_K": 1}})
    one_row_as_two(m.model_copy(update={"quantization": q}))
    level, width = q.accuracy_level, m.dims["hidden_size"]
    assert ("nbits", 8, 16, False, level, width) in rows._ONE_ROW


@pytest.mark.parametrize("level", [0, 4])
def test_a_quantized_lm_head_computes_a_wide_checks_rows_as_one_row_steps(tiny_dirs, tmp_path, level):
    """`--lm-head int4` on an int4 artifact: the final head is MatMulNBits, whose one-row kernel differs from its
    several-row one (level 0 on every CPU, level 4 on AVX2: this CPU's probe says which), so a draft's logits in a
    wide check would differ in the last bits from the one-row step's. Padded, a one-row call's input gets a zero row
    (as the segments' switch says): with the runtime's own session options each row's logits are bit for bit the same
    at every width on this CPU; with the switch off, or unpadded, they are exactly where this CPU's probe says."""
    import onnx
    import onnxruntime as ort

    from eectl.export.graphs import PAD_ROWS
    from eectl.runtime.ort import session_options

    def same(art, m, so) -> bool:
        final = m.exits[-1].full
        s = ort.InferenceSession(str(art / final.file), so, providers=["CPUExecutionProvider"])
        x = np.random.default_rng(level).standard_normal((6, m.dims["hidden_size"])).astype(np.float32)
        hidden, logits = final.inputs["hidden"], final.outputs["logits"]
        feed = {i.name: np.array([K], np.int64) for i in s.get_inputs() if i.name != hidden}
        wide = s.run([logits], {**feed, hidden: x})[0]
        ones = np.concatenate([s.run([logits], {**feed, hidden: x[i : i + 1]})[0] for i in range(6)])
        assert wide.shape == ones.shape == (6, m.dims["vocab_size"])
        return bool(np.array_equal(wide, ones))

    for pad in (True, False):
        int4 = Int4Options(min_agreement=0.3, accuracy_level=level, lm_head="int4")
        opts = ExportOptions(exits=EXITS, top_k=K, weights="int4", int4=int4, profile_costs=False, exact_wide=pad)
        art = tmp_path / f"pad{pad}"
        export_artifact(load_model(str(tiny_dirs["llama"])), art, opts)
        m = read_manifest(art)
        assert m.exits[-1].full.inputs.get("weight") is None  # the head holds its own quantized table
        ops = [n.op_type for n in onnx.load(str(art / m.exits[-1].full.file), load_external_data=False).graph.node]
        assert ops.count("MatMulNBits") == 1 and ("Concat" in ops) is pad
        kernel = one_row_as_two(m)
        rt = ArtifactRuntime(art, provider="cpu")
        assert same(art, m, rt.segment_options(session_options())) is (pad or kernel)  # what a run computes
        assert same(art, m, session_options()) is (pad or kernel)  # the graph's own switch: pad
        if pad:
            off, zero = session_options(), np.zeros(1, np.int64)  # ORT reads the value at session creation
            value = ort.OrtValue.ortvalue_from_numpy(zero)
            off.add_initializer(PAD_ROWS, value)
            assert same(art, m, off) is kernel  # the switch off: the one-row kernel's own answer
    if level == 0:
        assert not kernel  # level 0: the one-row kernel differs on every CPU, so both outcomes are seen here
