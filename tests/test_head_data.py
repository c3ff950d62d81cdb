"""Top-k + tail-bucket loss and the on-disk state cache, on the tiny seeded Llama."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eectl.exits.base import ExitHead
from eectl.exits.designs import load_heads
from eectl.heads.cached import train_cached
from eectl.heads.checkpoint import checkpoint_path
from eectl.heads.config import TrainConfig
from eectl.heads.losses import TeacherTopK, topk_tail_kl
from eectl.heads.state_cache import CacheSpec, open_cache, read_sequence
from eectl.heads.state_cache_build import build_cache


def test_topk_tail_kl_with_the_whole_vocabulary_is_the_exact_kl(llama):
    adapter = llama.adapter
    lens = ExitHead(adapter)
    g = torch.Generator().manual_seed(0)
    H, V = adapter.dims.hidden_size, adapter.dims.vocab_size
    mapped = torch.randn(2, 5, H, generator=g)  # [E, B, H]
    teacher_logits = torch.randn(5, V, generator=g) * 3
    # k = V: no tail, exact normaliser -> the exact KL(p || q) of every exit
    soft_ce, kl = topk_tail_kl(lens, mapped, TeacherTopK.of(teacher_logits, V), None)
    p = F.softmax(teacher_logits, -1)
    for e in range(2):
        logq = F.log_softmax(lens.full(mapped[e]), -1)
        exact = (p * (p.log() - logq)).sum(-1).mean()
        torch.testing.assert_close(kl[e], exact, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(soft_ce[e], -(p * logq).sum(-1).mean(), rtol=1e-4, atol=1e-5)
    # k < V with the exact normaliser: the bucketed KL is a lower bound of the exact one (data processing)
    _, kl_k = topk_tail_kl(lens, mapped, TeacherTopK.of(teacher_logits, 8), None)
    assert bool((kl_k <= kl + 1e-5).all())
    # the sampled normaliser with every outside row sampled equals the exact normaliser
    _, kl_s = topk_tail_kl(lens, mapped, TeacherTopK.of(teacher_logits, 8), V, torch.Generator().manual_seed(1))
    torch.testing.assert_close(kl_s, kl_k, rtol=1e-4, atol=1e-5)


def _alone(adapter, ids):
    """The base on one sequence alone: the state after every layer, and the final one."""
    states = {}

    def grab(i, _a, out):
        states[i + 1] = out[0]

    x = ids[None]
    pos = torch.arange(x.shape[1])[None]
    final = adapter.forward_layers(adapter.embed(x), pos, 0, adapter.num_layers, None, None, grab)
    return states, final[0]


def _small_spec(layers, text_tokens=200):
    """A tiny cache's spec: a few hundred tokens, short chunks and continuations."""
    return CacheSpec(
        layers=layers,
        text_tokens=text_tokens,
        gen_tokens=40,
        eval_text_tokens=64,
        eval_gen_tokens=4,
        gen_len=2,
        chunk_len=32,
        teacher_k=4,
        gen_batch=4,
    )


def test_state_cache_holds_the_base_states_and_resumes(llama, gsm8k, tmp_path):
    from eectl.phases import Phases

    spec = _small_spec([2, 4])
    phases = Phases()
    cache = build_cache(llama, gsm8k, spec, tmp_path / "c", phases=phases)
    assert cache.tokens("train", "text") >= 200 and cache.tokens("train", "gen") >= 40
    # each part's time with the budget size it scales with (the pipeline's verdict scales them)
    assert {n: p.size for n, p in phases.phases.items()} == {
        "state cache: train text": "text_tokens",
        "state cache: train continuations": "gen_steps",
        "state cache: held-out text": "fixed",  # the same in every budget
        "state cache: held-out continuations": "fixed",
    }
    assert phases.reused == "" and all(p.seconds > 0 for p in phases.phases.values())
    assert cache.tokens("held", "text") == 64 and cache.tokens("held", "gen") >= 4
    adapter = llama.adapter
    assert set(cache.timing) == {"text base", "generation", "teacher", "write"}
    for entry in cache.split("train", ("gen",))[:3] + cache.split("train", ("text",))[:1]:
        seq = read_sequence(cache.folder / entry.file)
        assert entry.length == seq.ids.numel() and entry.tokens == int(seq.measured.sum())
        # the cached states (kept from the batched, left-padded generation for generated sequences) are the
        # base's own on the sequence alone (float16), and the teacher is the final layer's top-k where measured
        states, final = _alone(adapter, seq.ids)
        for layer in (2, 4):
            torch.testing.assert_close(seq.states[layer].float(), states[layer], rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(seq.final.float(), final, rtol=1e-2, atol=1e-2)
        idx = torch.nonzero(seq.measured).flatten()
        assert seq.teacher_ids.shape == (idx.numel(), 4)
        assert torch.equal(seq.teacher_ids[:, 0], adapter.logits(final[idx]).argmax(-1))
        if entry.source == "gen":
            # measured positions predict the greedy continuation: the last prompt position onwards, the teacher's
            # top-1 is the next id (the last one's label, the continuation's last token, is not stored)
            assert bool(seq.measured[idx[0] :].all()) and int(idx[-1]) == seq.ids.numel() - 1
            assert torch.equal(seq.teacher_ids[:-1, 0], seq.ids[idx[:-1] + 1])
    # a second build with a larger budget keeps the sequences already there and adds new ones
    before = {e.file: (cache.folder / e.file).stat().st_mtime_ns for e in cache.entries}
    spec.text_tokens = 260
    again = Phases()
    bigger = build_cache(llama, gsm8k, spec, tmp_path / "c", phases=again)
    assert again.reused == "part of the state cache was there"  # its phases are not a fresh build's
    assert all((bigger.folder / f).stat().st_mtime_ns == t for f, t in before.items())
    assert bigger.tokens("train", "text") > cache.tokens("train", "text")
    assert open_cache(tmp_path / "c").tokens("train") == bigger.tokens("train")


def _tiny_cache(llama, gsm8k, folder):
    spec = CacheSpec(
        layers=[2, 4],
        text_tokens=300,
        gen_tokens=40,
        eval_text_tokens=96,
        eval_gen_tokens=4,
        gen_len=2,
        chunk_len=32,
        teacher_k=8,
        gen_batch=4,
    )
    return build_cache(llama, gsm8k, spec, folder)


@pytest.mark.parametrize("design,loss", [("residual-linear", "topk"), ("mlp", "exact"), ("block", "topk")])
def test_cached_training_lowers_held_out_kl_and_resumes_bit_identically(llama, gsm8k, tmp_path, design, loss):
    cache = _tiny_cache(llama, gsm8k, tmp_path / "c")
    cfg = dict(
        exits=[2, 4], design=design, steps=12, lr=3e-3, batch_tokens=32, loss=loss, tail_samples=64, save_every=6
    )
    res = train_cached(llama, cache, TrainConfig(**cfg), tmp_path / "a.safetensors")
    for b, a in zip(res.meta.report["before"]["exits"], res.meta.report["after"]["exits"], strict=True):
        assert a["kl"] < b["kl"]
    sizes = {
        "train heads": "train_steps",
        "probes": "probe_tokens",
        "held-out report": "fixed",
        "write heads": "fixed",
    }
    assert {n: p.size for n, p in res.phases.phases.items()} == sizes and res.phases.reused == ""
    # stop after step 6 (a checkpoint), resume: the same heads as the uninterrupted run, bit for bit

    def stop(step, _tokens, _kl):
        if step == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_cached(llama, cache, TrainConfig(**cfg), tmp_path / "b.safetensors", on_step=stop)
    resumed = train_cached(
        llama,
        cache,
        TrainConfig(**cfg),
        tmp_path / "b.safetensors",
        resume=checkpoint_path(tmp_path / "b.safetensors"),
    )
    assert resumed.phases.reused == "training resumed at step 6"
    a_heads = load_heads(tmp_path / "a.safetensors", llama)
    b_heads = load_heads(tmp_path / "b.safetensors", llama)
    assert a_heads.meta.design == design
    for layer in a_heads.exits:
        for p, q in zip(a_heads.heads[layer].parameters(), b_heads.heads[layer].parameters(), strict=True):
            assert torch.equal(p, q)


def test_cli_trains_a_block_from_a_state_cache(tiny_dirs, tmp_path):
    import json

    from typer.testing import CliRunner

    from eectl.cli import app
    from tests.tiny import GSM8K

    args = [
        "train-heads",
        str(tiny_dirs["llama"]),
        "--data",
        str(GSM8K),
        "--exits",
        "2,4",
        "--design",
        "block",
        "--cache",
        str(tmp_path / "c"),
        "--tokens",
        "512",
        "--eval-tokens",
        "128",
        "--threads",
        "1",
        "--out",
        str(tmp_path / "h.safetensors"),
        "--json",
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["design"] == "block" and doc["head_cost"]["layers"] == 1.0
    assert doc["training"]["loss"] == "topk" and (tmp_path / "c" / "cache.json").is_file()


def test_block_head_decoding_with_its_own_kv_equals_the_whole_sequence(llama):
    from eectl.exits.designs import BlockHead
    from eectl.models.parts import KVCache

    adapter = llama.adapter
    torch.manual_seed(0)
    head = BlockHead(adapter, adapter.num_layers - 1, identity=False).eval()
    h = torch.randn(1, 9, adapter.dims.hidden_size)
    with torch.no_grad():
        whole = head(h[0])
        cache = KVCache()
        steps = [head.step(h[:, :5], torch.arange(5)[None], cache)]  # prefill, then one token at a time
        steps += [head.step(h[:, t : t + 1], torch.tensor([[t]]), cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, 1)[0], whole, rtol=1e-5, atol=1e-5)
    identity = BlockHead(adapter, 3, identity=True)
    torch.testing.assert_close(identity(h[0]), h[0])  # zeroed output projections: starts as the logit lens


def test_calibrate_runs_block_heads_on_text_and_generation(llama, gsm8k, tmp_path):
    from eectl.calibrate.calibrator import CalibrateOptions, calibrate_model

    cache = _tiny_cache(llama, gsm8k, tmp_path / "c")
    cfg = TrainConfig(exits=[2, 4], design="block", steps=4, batch_tokens=32, tail_samples=64)
    train_cached(llama, cache, cfg, tmp_path / "b.safetensors")
    heads = load_heads(tmp_path / "b.safetensors", llama)
    opts = CalibrateOptions(exits=[2, 4], target=0.5, tokens=400, gen_tokens=4, chunk_len=32)
    cal = calibrate_model(llama, gsm8k, opts, heads.heads, tmp_path / "b.safetensors")
    assert cal.data.generated_tokens == 100 and [x.head for x in cal.exits] == [True, True]


def test_generation_keeps_the_states_calibrate_does_not_ask_for(llama, gsm8k):
    """Calibrate's generator, shared with the state cache: keeping states changes no token, and the kept states
    are the ones the generation computed (prompt and fed tokens of each row, padding left out)."""
    from eectl.exits.generation import Keep, generate_continuations, prompt_ids

    adapter = llama.adapter
    prompts = prompt_ids(llama.tokenizer, gsm8k.prompts[:5], 64)
    plain, used = generate_continuations(adapter, prompts, 17, 4, None, batch_size=3)
    kept, used_k = generate_continuations(adapter, prompts, 17, 4, None, batch_size=3, keep=Keep([3]))
    assert used == used_k and [c.generated for c in plain] == [c.generated for c in kept]
    assert sum(len(c.generated) for c in kept) == 17 and plain[0].states is None
    for c in kept:
        states, final = _alone(adapter, torch.tensor((c.prompt + c.generated)[:-1]))
        assert set(c.states) == {0, 3}
        torch.testing.assert_close(c.states[3], states[3], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(c.states[0], final, rtol=1e-4, atol=1e-4)


def test_shortlist_rows_join_the_exact_part_of_the_normaliser(llama):
    """With every row outside the teacher's top-k in the shortlist, the sampled tail is empty and the loss is the
    bucketed KL with the exact normaliser."""
    adapter = llama.adapter
    lens = ExitHead(adapter)
    g = torch.Generator().manual_seed(0)
    H, V = adapter.dims.hidden_size, adapter.dims.vocab_size
    mapped = torch.randn(2, 5, H, generator=g)
    teacher = TeacherTopK.of(torch.randn(5, V, generator=g) * 3, 8)
    _, exact_z = topk_tail_kl(lens, mapped, teacher, None)
    _, all_listed = topk_tail_kl(lens, mapped, teacher, 16, torch.Generator().manual_seed(1), torch.arange(V))
    torch.testing.assert_close(all_listed, exact_z, rtol=1e-4, atol=1e-5)


def test_a_cache_is_widened_to_more_layers_without_generating_again(llama, gsm8k, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from eectl.errors import UsageError
    from eectl.exits import measure as calibrate_measure

    narrow = build_cache(llama, gsm8k, _small_spec([2]), tmp_path / "c")
    before = {e.file: load_file(str(narrow.folder / e.file)) for e in narrow.entries}
    fresh = build_cache(llama, gsm8k, _small_spec([2, 4]), tmp_path / "fresh")

    def no_generation(*_a, **_k):
        raise AssertionError("a widen generates nothing")

    monkeypatch.setattr(calibrate_measure, "generate_continuations", no_generation)
    # stop the widen after two files: cache.json still names layer 2 only, and the rerun skips the files done
    calls = []

    def stop(n):
        calls.append(n)
        if len(calls) == 3:  # the first call counts the files already widened (none)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_cache(llama, gsm8k, _small_spec([2, 4]), tmp_path / "c", on_tokens=stop)
    assert open_cache(tmp_path / "c").layers == [2]
    stamps = {e.file: (narrow.folder / e.file).stat().st_mtime_ns for e in narrow.entries}
    counted = []
    wide = build_cache(llama, gsm8k, _small_spec([4, 2]), tmp_path / "c", on_tokens=counted.append)
    assert counted[0] == sum(calls[1:]) > 0  # the two files done before the stop: skipped, counted first
    assert sum(counted) == narrow.tokens("train") + narrow.tokens("held")
    assert sum(stamps[f] == (wide.folder / f).stat().st_mtime_ns for f in stamps) == 2
    assert wide.layers == [2, 4] and [asdict_(e) for e in wide.entries] == [asdict_(e) for e in narrow.entries]
    assert "widen" in wide.timing and wide.timing["generation"] == narrow.timing["generation"]
    assert [e.file for e in fresh.entries] == [e.file for e in wide.entries]
    for entry in wide.entries:
        got = load_file(str(wide.folder / entry.file))
        assert set(got) == set(before[entry.file]) | {"state_4"}
        for name, t in before[entry.file].items():  # what was stored is kept byte for byte
            assert t.dtype == got[name].dtype and torch.equal(t, got[name])
        # the new layer as a fresh build computes it: text the same way (equal up to batch composition), generated
        # teacher-forced against the generation's KV-cached, left-padded batch: float16 rounding apart (1e-2)
        want = load_file(str(fresh.folder / entry.file))
        assert torch.equal(got["ids"], want["ids"])
        torch.testing.assert_close(got["state_4"].float(), want["state_4"].float(), rtol=1e-2, atol=1e-2)
    # a cache asked for a layer it holds is reused; a spec that differs in more than layers is still refused
    assert build_cache(llama, gsm8k, _small_spec([4]), tmp_path / "c").layers == [2, 4]
    with pytest.raises(UsageError, match="other token budgets"):
        build_cache(llama, gsm8k, _small_spec([2, 3], text_tokens=260), tmp_path / "c")
    other = _small_spec([2, 3])
    other.teacher_k = 8
    with pytest.raises(UsageError, match="another model, data or spec"):
        build_cache(llama, gsm8k, other, tmp_path / "c")


def asdict_(entry):
    from dataclasses import asdict

    return asdict(entry)


def test_heads_trained_at_other_exits_merge_into_one_file(llama, gsm8k, tmp_path):
    from eectl.errors import ArtifactError
    from eectl.exits.designs import merge_heads

    cache = _tiny_cache(llama, gsm8k, tmp_path / "c")
    common = dict(design="residual-linear", steps=3, batch_tokens=32, tail_samples=64)
    for name, exits in (("a", [4]), ("b", [2]), ("c", [2])):
        train_cached(llama, cache, TrainConfig(exits=exits, **common), tmp_path / f"{name}.safetensors")
    train_cached(llama, cache, TrainConfig(exits=[2], **{**common, "design": "mlp"}), tmp_path / "m.safetensors")
    a, b = load_heads(tmp_path / "a.safetensors", llama), load_heads(tmp_path / "b.safetensors", llama)
    assert a.meta.probe is not None  # the trainer fits probes; a merge drops them (refit onto the merged file)
    meta = merge_heads([tmp_path / "a.safetensors", tmp_path / "b.safetensors"], llama, tmp_path / "ab.safetensors")
    ab = load_heads(tmp_path / "ab.safetensors", llama)
    assert ab.exits == meta.exits == [2, 4] and ab.meta.probe is None and ab.meta.design == "residual-linear"
    assert [x["exits"] for x in ab.meta.training["merged_from"]] == [[4], [2]]
    for layer, src in ((2, b), (4, a)):  # each head as trained, bit for bit
        for p, q in zip(ab.heads[layer].parameters(), src.heads[layer].parameters(), strict=True):
            assert torch.equal(p, q)
    with pytest.raises(ArtifactError, match="repeat exits"):
        merge_heads([tmp_path / "b.safetensors", tmp_path / "c.safetensors"], llama, tmp_path / "x.safetensors")
    with pytest.raises(ArtifactError, match="design"):
        merge_heads([tmp_path / "a.safetensors", tmp_path / "m.safetensors"], llama, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_states_past_float16s_range_are_stored_scaled_by_a_power_of_two(tmp_path):
    """Rows inside float16's range are stored as the plain conversion (the bytes caches held before scales); a row
    past it is divided by the smallest power of two that brings it inside, and read back to float16 precision."""
    from eectl.heads.state_cache import HALF_MAX, Sequence, decode_half, encode_half, write_sequence

    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 16, generator=g) * 100
    half, scale = encode_half(h)
    assert scale is None and torch.equal(half, h.to(torch.float16))
    h[2, 3], h[4] = 1.0e5, h[4] * 3000  # Gemma 3's residual stream reaches ~1e5 at BOS
    half, scale = encode_half(h)
    assert scale is not None and bool(torch.isfinite(half).all())
    peak = h.abs().amax(-1)
    assert scale[[0, 1, 3]].tolist() == [1.0, 1.0, 1.0] and torch.equal(half[[0, 1, 3]], h[[0, 1, 3]].half())
    for r in (2, 4):
        k = torch.log2(scale[r])
        assert k == k.round() and k >= 1 and peak[r] / scale[r] <= HALF_MAX < peak[r] / scale[r] * 2
    torch.testing.assert_close(decode_half(half, scale), h, rtol=1e-3, atol=1e-3)
    # through a cache file: float32 where scaled, float16 (byte for byte) where not
    seq = Sequence(torch.arange(5), torch.ones(5, dtype=torch.bool), {2: h, 3: h[:, :8] / 1e4}, h, *_teacher(5))
    write_sequence(tmp_path / "s.safetensors", seq)
    back = read_sequence(tmp_path / "s.safetensors")
    assert back.states[2].dtype == back.final.dtype == torch.float32 and back.states[3].dtype == torch.float16
    torch.testing.assert_close(back.states[2], h, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(back.final, h, rtol=1e-3, atol=1e-3)


def _teacher(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(n, 2, dtype=torch.long), torch.zeros(n, 2)


def test_a_model_with_massive_activations_trains_finite_heads(tiny_dirs, gsm8k, tmp_path):
    """A residual stream past float16's range (embeddings scaled by 1e8, ~2e6 a value): the cache holds the states
    (to float16's relative precision) and the heads train to finite losses and weights (they trained to NaN when the
    cache stored such states as inf)."""
    from safetensors.torch import load_file, save_file

    from eectl.errors import EectlError
    from eectl.models import load_model

    big = load_model(str(tiny_dirs["llama"]))
    with torch.no_grad():
        big.model.get_input_embeddings().weight.mul_(1e8)
    cache = build_cache(big, gsm8k, _small_spec([2, 4], text_tokens=96), tmp_path / "c")
    for entry in cache.split("train")[:2] + cache.split("held")[:1]:
        seq = read_sequence(cache.folder / entry.file)
        states, final = _alone(big.adapter, seq.ids)
        assert states[2].abs().max() > 1e6  # past float16's range indeed
        for layer in (2, 4):
            torch.testing.assert_close(seq.states[layer], states[layer], rtol=1e-3, atol=1e-3 * 1e6)
        torch.testing.assert_close(seq.final, final, rtol=1e-3, atol=1e-3 * 1e6)
    cfg = TrainConfig(exits=[2, 4], design="residual-linear", steps=6, batch_tokens=32, tail_samples=64)
    res = train_cached(big, cache, cfg, tmp_path / "h.safetensors")
    heads = load_heads(res.out, big)
    assert all(bool(torch.isfinite(p).all()) for m in heads.heads.values() for p in m.parameters())
    report = res.meta.model_dump()
    assert all(v == v for v in _numbers(report)), report  # no NaN anywhere in the report
    # the same cache as an older eectl wrote it (float16 without scales: the rows overflowed to inf): training stops
    # with the exits named, and says what to do, before heads are written
    for entry in cache.entries:
        path = cache.folder / entry.file
        seq = read_sequence(path)
        t = {k: v for k, v in load_file(str(path)).items() if not k.startswith(("scale_", "state_"))}
        t.update({f"state_{layer}": h.half() for layer, h in seq.states.items()}, final=seq.final.half())
        save_file(t, str(path))
    cache = open_cache(cache.folder)
    with pytest.raises(EectlError, match=r"exits \[2, 4\] have non-finite weights") as err:
        train_cached(big, cache, cfg, tmp_path / "old.safetensors")
    assert "build it again" in (err.value.hint or "") and not (tmp_path / "old.safetensors").exists()


def _numbers(doc):
    if isinstance(doc, dict):
        for v in doc.values():
            yield from _numbers(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from _numbers(v)
    elif isinstance(doc, float):
        yield doc


def test_diverged_heads_are_refused_before_anything_is_written(llama):
    """Training that ends with NaN weights stops with the exits named (train-heads wrote such heads, and only
    calibrate refused them)."""
    from eectl.errors import EectlError
    from eectl.exits.designs import HeadStack, check_trained, make_head

    H = llama.adapter.dims.hidden_size
    stack = HeadStack({layer: make_head("residual-linear", H, None) for layer in (2, 4)})
    check_trained(stack, 5)  # finite: nothing said
    with torch.no_grad():
        next(stack.head(4).parameters()).fill_(float("nan"))
    with pytest.raises(EectlError, match=r"exits \[4\] have non-finite weights after 5 steps"):
        check_trained(stack, 5)
