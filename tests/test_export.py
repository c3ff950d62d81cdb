"""Export on tiny models of every family: graphs equal PyTorch for prefill, decode and chunks at every exit;
the manifest round-trips and is rejected when inconsistent; export is atomic."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

from eectl.cli import app
from eectl.contracts.manifest import MANIFEST, SCHEMA_VERSION, read_manifest, write_manifest
from eectl.errors import ArtifactError, UsageError
from eectl.exits.base import ExitHead
from eectl.exits.designs import make_head
from eectl.export import graphs as export_graphs
from eectl.export import validation as export_validation
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.export.validation import ExportValidationError
from eectl.models import KVCache, load_model
from eectl.runtime.sessions import ArtifactRuntime
from tests.conftest import make_calibration, make_heads_meta

EXITS = [2, 4]
ATOL = 1e-4


def test_manifest_records_validation_and_names(exported, family):
    loaded, art = exported[family]
    m = read_manifest(art)
    assert [s.layers for s in m.segments] == [(0, 2), (2, 4), (4, 6)]
    assert m.exit_layers == EXITS and m.exits[-1].layer == 6
    v = m.validation
    assert v["passed"] and v["decode_steps"] == 16
    assert set(v["max_abs_logit_diff"]) == {"2", "4", "6"} and max(v["max_abs_logit_diff"].values()) < 1e-3
    assert all(n == 0 for n in v["greedy_token_mismatches"].values())
    assert m.kv.past_key[3] == "past_key_values.3.key" and m.kv.present_value[5] == "present.5.value"
    assert m.segments[1].graph.inputs["past_key"] == ["past_key_values.2.key", "past_key_values.3.key"]
    assert m.model["sha256"] == loaded.source.sha256 and m.family == family


def test_ort_equals_torch_for_prefill_chunk_and_decode_at_every_exit(exported, family):
    loaded, art = exported[family]
    adapter = loaded.adapter
    rt = ArtifactRuntime(art, provider="cpu", threads=1)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, adapter.dims.vocab_size, (1, 30), generator=g)
    kv = rt.new_kv(1, 40)
    cache = KVCache()
    heads = {e: ExitHead(adapter) for e in [*EXITS, 6]}
    with torch.no_grad():
        for lo, hi in [(0, 12), (12, 19), (19, 20), (20, 21), (21, 30)]:  # prefill, chunk on a past, decodes
            states = {}
            adapter.forward_layers(
                adapter.embed(ids[:, lo:hi]),
                torch.arange(lo, hi)[None],
                0,
                adapter.num_layers,
                cache,
                on_layer=lambda i, a, b, states=states: states.__setitem__(i + 1, b),
            )
            h = rt.embed(ids[:, lo:hi].numpy())
            for s in range(3):
                h, layer_in = rt.run_segment(s, h, kv, row=0)
                end = rt.manifest.segments[s].layers[1]
                ref = heads[end].full(states[end][0])
                got, cand, cand_logits = rt.exit_full(end, h[0], 8)
                np.testing.assert_allclose(got, ref.numpy(), atol=ATOL, rtol=1e-4)
                # the in-graph greedy token, for a chunk of positions then one (its scratch arrays resize)
                assert (rt.greedy_token(end, h[0]) == ref.argmax(-1).numpy()).all()
                np.testing.assert_allclose(layer_in[0], states[end - 1][0].numpy(), atol=ATOL, rtol=1e-4)
                local = rt.exit_local(end, h[0], cand)
                np.testing.assert_allclose(local, cand_logits, atol=ATOL, rtol=1e-4)
                assert (cand == torch.topk(ref, 8).indices.numpy()).all()
        assert (kv.filled == 30).all()
        for i in range(adapter.num_layers):
            np.testing.assert_allclose(kv.keys[0][i][:, :, :30], cache.keys[i].numpy(), atol=ATOL, rtol=1e-4)


def test_external_data_aligns_large_tensors_and_packs_small_ones(tmp_path):
    """Tensors >= EXTERNAL_ALIGN_MIN_BYTES start on a 64 KiB boundary (mappable); smaller ones follow each other
    without padding, and every tensor reads back as written."""
    from onnx import helper, numpy_helper

    from eectl.contracts.manifest import GraphIO

    rng = np.random.default_rng(0)
    big = export_graphs.EXTERNAL_ALIGN_MIN_BYTES // 4 + 3  # float32 elements: just over the threshold
    arrays = {"s0": rng.standard_normal(700), "w0": rng.standard_normal(big), "s1": rng.standard_normal(600)}
    arrays |= {"w1": rng.standard_normal(big), "s2": rng.standard_normal(500)}
    inits = [numpy_helper.from_array(a.astype(np.float32), k) for k, a in arrays.items()]
    nodes = [helper.make_node("Identity", [k], [f"{k}_out"]) for k in arrays]
    outs = [helper.make_tensor_value_info(f"{k}_out", onnx.TensorProto.FLOAT, None) for k in arrays]
    model = helper.make_model(helper.make_graph(nodes, "g", [], outs, inits))
    io = export_graphs.save_graph(model, GraphIO(file="g.onnx", inputs={}, outputs={}), tmp_path)
    proto = onnx.load(str(tmp_path / "g.onnx"), load_external_data=False)
    place = {
        t.name: {d.key: int(d.value) for d in t.external_data if d.key != "location"} for t in proto.graph.initializer
    }
    assert io.data == "g.onnx.data"
    assert (
        place["w0"]["offset"] % export_graphs.EXTERNAL_ALIGN == 0
        and place["w1"]["offset"] % export_graphs.EXTERNAL_ALIGN == 0
    )
    assert place["s0"]["offset"] == 0 and place["s1"]["offset"] == place["w0"]["offset"] + place["w0"]["length"]
    assert place["s2"]["offset"] == place["w1"]["offset"] + place["w1"]["length"]
    loaded = onnx.load(str(tmp_path / "g.onnx"))
    for t in loaded.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(t), arrays[t.name].astype(np.float32))


def test_graph_weights_are_external_data_listed_and_hashed(exported):
    _, art = exported["llama"]
    m = read_manifest(art)
    graphs = [g for s in m.segments for g in (s.graph, s.kv_graph)] + [g for e in m.exits for g in (e.full, e.local)]
    for g in [m.embedding, *graphs]:
        proto = onnx.load(str(art / g.file), load_external_data=False)
        big = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        inline = [t for t in proto.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
        assert all(len(t.raw_data) < export_graphs.EXTERNAL_MIN_BYTES for t in inline)
        places = [{d.key: int(d.value) for d in t.external_data if d.key != "location"} for t in big]
        aligned = [p["offset"] for p in places if p["length"] >= export_graphs.EXTERNAL_ALIGN_MIN_BYTES]
        assert all(o % export_graphs.EXTERNAL_ALIGN == 0 for o in aligned)
        spans = sorted((p["offset"], p["offset"] + p["length"]) for p in places)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # no overlap
        assert g.data == (g.file + ".data" if big else None) and g.file in m.files
        assert g.data is None or g.data in m.files
    assert all(s.graph.data and s.kv_graph.data for s in m.segments)
    assert m.embedding.data is None  # its table is bound at run time
    seg = art / m.segments[0].graph.file
    assert seg.stat().st_size < 20_000 < (art / m.segments[0].graph.data).stat().st_size


def test_manifest_rejected_when_inconsistent(exported, tmp_path):
    _, art = exported["llama"]
    bad = tmp_path / "edited"
    shutil.copytree(art, bad)
    seg = bad / read_manifest(bad).segments[1].graph.file
    seg.write_bytes(seg.read_bytes() + b"\0")
    with pytest.raises(ArtifactError, match="hash mismatch"):
        read_manifest(bad)
    seg.unlink()
    with pytest.raises(ArtifactError, match="missing"):
        read_manifest(bad)
    shutil.rmtree(bad)
    shutil.copytree(art, bad)
    data = bad / read_manifest(bad).segments[1].graph.data
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1  # one bit of one weight
    data.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="hash mismatch"):
        read_manifest(bad)
    doc = json.loads((bad / MANIFEST).read_text())
    del doc["files"][doc["segments"][1]["graph"]["data"]]
    (bad / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="not hashed"):
        read_manifest(bad)
    shutil.rmtree(bad)
    shutil.copytree(art, bad)
    doc = json.loads((bad / MANIFEST).read_text())
    doc["schema_version"] = 99
    (bad / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="schema version"):
        read_manifest(bad)
    doc["schema_version"] = 1
    (bad / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="older manifest schema version 1"):  # artifacts of an older eectl
        read_manifest(bad)
    doc["schema_version"] = 2  # version 3 only added optional fields: a version 2 artifact still loads
    (bad / MANIFEST).write_text(json.dumps(doc))
    assert read_manifest(bad, verify_hashes=False).schema_version == 2
    doc["schema_version"] = SCHEMA_VERSION
    doc["segments"] = doc["segments"][:2]
    (bad / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="tile"):
        read_manifest(bad)
    with pytest.raises(ArtifactError, match="not found"):
        read_manifest(tmp_path / "nothing")


def test_manifest_round_trips_with_its_calibration_and_heads(tiny_dirs, tmp_path):
    """Written by export with a typed calibration and heads metadata, read back equal, rewritten byte-identical."""
    loaded = load_model(str(tiny_dirs["llama"]))
    cal = make_calibration(loaded, {2: {"prob": float("inf")}, 4: {"prob": 0.25}})
    heads = {4: make_head("low-rank", loaded.adapter.dims.hidden_size, 4, torch.Generator().manual_seed(0))}
    meta = make_heads_meta(loaded, [4], "low-rank", rank=4)
    art = tmp_path / "a"
    written = export_artifact(loaded, art, ExportOptions(exits=[2, 4], top_k=8), heads, meta, cal)
    back = read_manifest(art)
    assert back == written and back.calibration == cal and back.heads == meta
    assert back.calibration is not None and back.calibration.exits[0].never  # inf survives the file's null
    assert json.loads((art / MANIFEST).read_text())["calibration"]["exits"][0]["thresholds"] == {"prob": None}
    again = tmp_path / "b"
    shutil.copytree(art, again)
    (again / MANIFEST).unlink()
    write_manifest(back, again)
    assert (again / MANIFEST).read_bytes() == (art / MANIFEST).read_bytes()
    assert read_manifest(again) == back


def test_export_is_atomic_and_needs_force(tiny_dirs, tmp_path, monkeypatch):
    loaded = load_model(str(tiny_dirs["qwen2"]))
    out = tmp_path / "art"
    export_artifact(loaded, out, ExportOptions(exits=[3]))
    before = read_manifest(out).files
    with pytest.raises(ArtifactError, match="already exists"):
        export_artifact(loaded, out, ExportOptions(exits=[2]))
    assert read_manifest(out).files == before
    monkeypatch.setitem(export_validation.TOLERANCE, "fp32", 0.0)  # every export now fails its validation
    with pytest.raises(ExportValidationError):
        export_artifact(loaded, out, ExportOptions(exits=[2], force=True))
    assert read_manifest(out).files == before  # the old artifact survived the failed replacement
    with pytest.raises(ExportValidationError):
        export_artifact(loaded, tmp_path / "new", ExportOptions(exits=[2]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no half-written folder left behind
    monkeypatch.undo()
    export_artifact(loaded, out, ExportOptions(exits=[2], force=True))
    assert read_manifest(out).exit_layers == [2]


@pytest.mark.parametrize("exits", [[0], [6], [2, 2], [7]])
def test_bad_exits(tiny_dirs, tmp_path, exits):
    loaded = load_model(str(tiny_dirs["llama"]))
    with pytest.raises(UsageError):
        export_artifact(loaded, tmp_path / "a", ExportOptions(exits=exits))
    assert not (tmp_path / "a").exists()


def test_trained_head_is_inlined_into_the_exit_graphs(tiny_dirs, tmp_path):
    loaded = load_model(str(tiny_dirs["gemma3_text"]))
    H = loaded.adapter.dims.hidden_size
    torch.manual_seed(0)

    class Residual(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(H, H)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.proj(h)

    m = export_artifact(loaded, tmp_path / "a", ExportOptions(exits=[3]), heads={3: Residual().eval()})
    assert m.validation["passed"] and m.exits[0].head == "Residual"


def test_fp16_export_validates_at_fp16_tolerance(tiny_dirs, tmp_path):
    loaded = load_model(str(tiny_dirs["llama"]))
    m = export_artifact(loaded, tmp_path / "a", ExportOptions(exits=[3], dtype="fp16"))
    v = m.validation
    assert m.dtype == "fp16" and v["passed"] and v["tolerance"] == 0.25
    assert 1e-5 < max(v["max_abs_logit_diff"].values()) < 0.25  # fp16 rounding is visible, and bounded
    assert np.load(tmp_path / "a" / "weights" / "lm_head.npy").dtype == np.float16


def test_fp16_export_of_states_past_float16s_range_fails_saying_fp32(tiny_dirs, tmp_path):
    """A residual stream past 65,504 in one dimension (Gemma 3's massive activations; here one embedding column set to
    1e5) is inf in fp16 graphs: validation fails and says to export fp32, where the same model exports and
    validates."""
    loaded = load_model(str(tiny_dirs["llama"]))
    with torch.no_grad():
        loaded.model.get_input_embeddings().weight[:, 0] = 1e5
    with pytest.raises(ExportValidationError, match="non-finite values") as err:
        export_artifact(loaded, tmp_path / "a", ExportOptions(exits=[3], dtype="fp16", profile_costs=False))
    assert "--dtype fp32" in (err.value.hint or "") and not (tmp_path / "a").exists()
    m = export_artifact(loaded, tmp_path / "b", ExportOptions(exits=[3], profile_costs=False))
    assert m.dtype == "fp32" and m.validation["passed"]


def test_cli_export_json(tiny_dirs, tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli-art"
    res = runner.invoke(
        app, ["export", str(tiny_dirs["mistral"]), "--exits", "1,3", "--out", str(out), "--json", "--threads", "1"]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["exits"] == [1, 3] and doc["segments"] == [[0, 1], [1, 3], [3, 6]] and doc["validation"]["passed"]
    res = runner.invoke(app, ["export", str(tiny_dirs["mistral"]), "--exits", "1,3", "--out", str(out)])
    assert res.exit_code == 5 and "already exists" in res.stderr
    res = runner.invoke(app, ["export", str(tiny_dirs["mistral"]), "--exits", "9", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "outside" in res.stderr
