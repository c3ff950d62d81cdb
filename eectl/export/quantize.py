"""Weight-only int4 graphs: ONNX Runtime's own MatMulNBits quantizer applied to eectl's built graphs.

`eectl export --weights int4` passes every segment graph (and its K/V-only twin) through
`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`: each MatMul whose weight is a constant
becomes a block-wise `com.microsoft::MatMulNBits` (4-bit weights, one scale per block of `block_size` input
channels, a zero point unless symmetric). Activations stay fp32; `accuracy_level` picks the kernel's compute type
(0: unset, fp32; 4: int8 activations, the fast path on CPUs with VNNI). `eectl export --river` writes int4 copies of
the segments after the first exit with the same quantizer (River-LLM's W4A16 exit river).

What stays in higher precision, and why:
- the embedding (a Gather over the shared fp32 table: a lookup, not a matmul, so int4 would save no time);
- the exit graphs' LM head: exits bind the one shared fp32 table. The **final** head may be quantized
  (`lm_head`: int8 or int4) because at int4 depth it becomes the largest single matmul of a token; it then gets
  its own constant copy of the table in the final exit graph (the shared table stays for the embedding and the
  intermediate exits);
- decoder layers listed in `keep_layers` (their MatMuls are excluded from the quantizer).

From a GGUF of quantized blocks (`--int4-from gguf`, the default `auto` picks it for such a file), the segments'
projections are instead the file's own blocks (models/gguf_blocks.py): `gguf_graph` replaces each projection MatMul
with MatMulNBits nodes whose weights dequantize to the file's values bit for bit, plus, for types with a per-block
min (Q4_1, Q4_K), llama.cpp's min term:

    x [.., K] --> MatMulNBits(x; q, scale, zero point) --> (Concat of the groups) --> Add --> y
             |                                                            |
             +--> Reshape [.., K/32, 32] -> ReduceSum -> MatMul(mins [K/32, N])

(a float zero point would hold the min in the operator itself, but ORT 1.31's CPU kernel then dequantizes B on every
call: 5.6 ms against 0.13-0.16 ms for a 576 x 1536 product, 2 threads).

What this module does not do: build graphs (export/exporter.py), or write a quantizer of its own (ORT's is the real
one), or read GGUF blocks (models/gguf_blocks.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from eectl.errors import ModelLoadError, UsageError

if TYPE_CHECKING:  # onnx is imported where graphs are touched: the CLI imports this module for its defaults
    import onnx

    from eectl.models.gguf_blocks import GgufProjections, NBitsWeight
    from eectl.models.loading import LoadedModel, ModelSource

ALGORITHMS = ("rtn", "hqq")  # ORT's DefaultWeightOnlyQuantConfig (round to nearest, per block) and HQQ
LM_HEAD_PRECISIONS = ("fp32", "int8", "int4")
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
# where int4 weights come from: auto (the GGUF's own blocks where the model is a GGUF of quantized blocks and no ORT
# quantizer setting is given, else ORT's quantizer), gguf (the file's blocks, models/gguf_blocks.py) or ort (ORT's
# quantizer over the fp32 weights, --int4-algorithm)
INT4_SOURCES = ("auto", "gguf", "ort")
# Greedy agreement with PyTorch (teacher-forced, final exit) below which an int4 export fails. A floor against broken
# graphs (random tokens agree on ~1/V), not a quality target: small models lose a lot to int4 (SmolLM2-135M, whose
# source is a Q4_1 GGUF re-quantized here: 71% at block 32); raise it for models where int4 is known to hold up.
DEFAULT_MIN_AGREEMENT = 0.5


@dataclass(frozen=True)
class Int4Options:
    block_size: int = 32  # input channels per scale (a power of two >= 16)
    symmetric: bool = False  # no zero points (int4 in [-8, 7]) vs a zero point per block (uint4)
    accuracy_level: int = 4  # MatMulNBits compute type: 0 unset (fp32), 1 fp32, 2 fp16, 3 bf16, 4 int8
    algorithm: str = "rtn"
    lm_head: str = "fp32"  # the final exit's LM head: fp32 (shared table), int8 or int4 (own constant copy)
    keep_layers: tuple[int, ...] = ()  # decoder layers whose MatMuls stay fp32
    min_agreement: float = DEFAULT_MIN_AGREEMENT  # validation floor on greedy agreement at the final exit
    source: str = "auto"  # INT4_SOURCES: where the segments' int4 weights come from (--int4-from)

    def check(self, num_layers: int | None) -> Int4Options:
        """Every value in range; the kept layers against `num_layers` when it is known (None: before the model
        loads, when export checks the rest)."""
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise UsageError(f"--int4-block-size must be a power of two >= 16, got {self.block_size}")
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise UsageError(f"--int4-accuracy-level must be one of 0..4, got {self.accuracy_level}")
        if self.algorithm not in ALGORITHMS:
            raise UsageError(f"--int4-algorithm must be one of {', '.join(ALGORITHMS)}, got '{self.algorithm}'")
        if self.lm_head not in LM_HEAD_PRECISIONS:
            raise UsageError(f"--lm-head must be one of {', '.join(LM_HEAD_PRECISIONS)}, got '{self.lm_head}'")
        if num_layers is None:
            negative = [i for i in self.keep_layers if i < 0]
            if negative:
                raise UsageError(f"--int4-keep-layers {negative} are not layer numbers (0 and up)")
        elif bad := [i for i in self.keep_layers if not 0 <= i < num_layers]:
            raise UsageError(f"--int4-keep-layers {bad} are outside 0..{num_layers - 1}")
        if self.algorithm == "hqq" and self.symmetric:
            raise UsageError("--int4-algorithm hqq is asymmetric (zero points per block); drop --int4-symmetric")
        if self.source not in INT4_SOURCES:
            raise UsageError(f"--int4-from must be one of {', '.join(INT4_SOURCES)}, got '{self.source}'")
        if self.source == "gguf" and (quantizer := self.quantizer_settings()):
            raise UsageError(
                f"{quantizer[0]} shapes ORT's re-quantization; --int4-from gguf holds the file's own blocks",
                hint="drop it, or pass --int4-from ort",
            )
        if not 0.0 <= self.min_agreement <= 1.0:
            raise UsageError(f"--min-agreement must be in [0, 1], got {self.min_agreement}")
        return self

    def quantizer_settings(self) -> list[str]:
        """The flags of ORT's quantizer set away from their defaults (they mean nothing for the GGUF's blocks)."""
        from eectl.models.gguf_blocks import quantizer_flags

        return quantizer_flags(self)

    def resolved(self, model: ModelSource) -> Int4Options:
        """These options with `source` decided, gguf or ort, for the model loaded from `model`
        (models/gguf_blocks.py int4_source: auto takes a GGUF's own quantized blocks)."""
        from eectl.models.gguf_blocks import int4_source

        return replace(self, source=int4_source(self, model))

    def record(self, scope: str, gguf: GgufProjections | None = None) -> dict[str, Any]:
        """What the manifest's `quantization` field holds (manifest.Quantization)."""
        import onnxruntime

        d = asdict(self)
        d["keep_layers"] = list(self.keep_layers)
        tool = f"onnxruntime.quantization.matmul_nbits_quantizer {onnxruntime.__version__}"
        extra: dict[str, Any] = {}
        if gguf is not None and scope == "segments":
            from eectl.models.gguf_blocks import head_blocks

            d.update(algorithm="gguf", symmetric=False)
            tool = f"eectl.models.gguf_blocks (the file's own blocks: {gguf.path.name})"
            extra = gguf.record()
            if head_blocks(gguf, self) is not None:
                extra.update(lm_head_source="gguf", lm_head_gguf_type=gguf.head_type)
        else:
            d["source"] = "ort"
        return {
            **d,
            **extra,
            "scope": scope,
            "bits": 4,
            "op": "com.microsoft::MatMulNBits",
            "tool": tool,
            "embedding": "fp32",
            "exit_lm_heads": "fp32",
        }


def _config(opts: Int4Options, bits: int = 4) -> Any:
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        HQQWeightOnlyQuantConfig,
    )

    if opts.algorithm == "hqq" and bits == 4:
        return HQQWeightOnlyQuantConfig(block_size=opts.block_size, bits=4)
    return DefaultWeightOnlyQuantConfig(
        block_size=opts.block_size,
        is_symmetric=opts.symmetric,
        accuracy_level=opts.accuracy_level or None,
        bits=bits,
    )


def quantize_graph(model: onnx.ModelProto, opts: Int4Options, bits: int = 4) -> onnx.ModelProto:
    """A copy of `model` with every constant-weight MatMul as MatMulNBits, except the layers kept in fp32.

    Nodes are named after their weight initializer first (eectl's builder names weights `layers.{i}.<proj>`), so
    the quantizer's exclusion list can name the kept layers.
    """
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    inits = {i.name for i in m.graph.initializer}
    exclude = []
    for n, node in enumerate(m.graph.node):
        if node.op_type == "MatMul" and len(node.input) > 1 and node.input[1] in inits:
            node.name = node.name or f"{node.input[1]}.matmul_{n}"
            if any(node.input[1].startswith(f"layers.{i}.") for i in opts.keep_layers):
                exclude.append(node.name)
    q = MatMulNBitsQuantizer(m, algo_config=_config(opts, bits), nodes_to_exclude=exclude)
    q.process()
    out: onnx.ModelProto = q.model.model
    if opts.accuracy_level:  # ORT's HQQ path leaves the (optional) compute-type attribute unset
        for node in out.graph.node:
            if node.op_type == "MatMulNBits" and not any(a.name == "accuracy_level" for a in node.attribute):
                node.attribute.append(onnx.helper.make_attribute("accuracy_level", opts.accuracy_level))
    return out


def gguf_graph(model: onnx.ModelProto, gguf: GgufProjections, opts: Int4Options) -> onnx.ModelProto:
    """A copy of `model` with each decoder projection MatMul (initializer `layers.{i}.{qkv,o,gate_up,down}`) whose
    GGUF tensors are held (models/gguf_blocks.py HELD) replaced by MatMulNBits on the file's own blocks, plus the
    min term where the blocks have one; the layers in `opts.keep_layers`, and projections of other types, stay
    fp32 MatMuls of the (dequantized) weights."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    wanted: dict[str, list[NBitsWeight]] = {
        f"layers.{layer}.{name}": parts for (layer, name), parts in gguf.fused.items() if layer not in opts.keep_layers
    }
    used = set()
    nodes: list[onnx.NodeProto] = []
    new_inits: list[onnx.TensorProto] = []
    for node in m.graph.node:
        weight = node.input[1] if node.op_type == "MatMul" and len(node.input) > 1 else ""
        if weight not in wanted:
            nodes.append(node)
            continue
        used.add(weight)
        made, inits = _nbits_nodes(node.input[0], node.output[0], weight, wanted[weight], opts.accuracy_level)
        nodes.extend(made)
        new_inits.extend(inits)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    keep = [t for t in m.graph.initializer if t.name not in used]
    del m.graph.initializer[:]
    m.graph.initializer.extend([*keep, *new_inits])
    return m


def _nbits_nodes(
    x: str, y: str, name: str, parts: list[NBitsWeight], accuracy_level: int
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """x @ W as MatMulNBits groups (concatenated along N) + BlockSum_32(x) @ mins: the nodes and initializers."""
    from onnx import helper, numpy_helper

    from eectl.models.gguf_blocks import MIN_BLOCK

    nodes, inits, outs = [], [], []
    K = parts[0].K
    N = sum(p.N for p in parts)
    mins = [p for p in parts if p.mins is not None]
    for g, p in enumerate(parts):
        stem = f"{name}.nbits{g}"
        inits += [
            numpy_helper.from_array(p.packed(), f"{stem}.B"),
            numpy_helper.from_array(np.ascontiguousarray(p.scales.reshape(-1)), f"{stem}.scales"),
            numpy_helper.from_array(p.packed_zero_points(), f"{stem}.zero_points"),
        ]
        out = y if len(parts) == 1 and not mins else f"{stem}.y"
        nodes.append(
            helper.make_node(
                "MatMulNBits",
                [x, f"{stem}.B", f"{stem}.scales", f"{stem}.zero_points"],
                [out],
                name=f"{stem}.matmul",
                domain="com.microsoft",
                K=K,
                N=p.N,
                bits=p.bits,
                block_size=p.block,
                accuracy_level=accuracy_level,
            )
        )
        outs.append(out)
    if len(parts) > 1:
        joined = y if not mins else f"{name}.nbits.y"
        nodes.append(helper.make_node("Concat", outs, [joined], name=f"{name}.concat", axis=-1))
        outs = [joined]
    if mins:
        table = np.concatenate(
            [p.mins if p.mins is not None else np.zeros((K // MIN_BLOCK, p.N), np.float32) for p in parts], axis=1
        )
        assert table.shape == (K // MIN_BLOCK, N)
        inits += [
            numpy_helper.from_array(np.ascontiguousarray(table), f"{name}.mins"),
            numpy_helper.from_array(np.array([0, 0, K // MIN_BLOCK, MIN_BLOCK], np.int64), f"{name}.blocks"),
            numpy_helper.from_array(np.array([-1], np.int64), f"{name}.last_axis"),
        ]
        nodes += [
            helper.make_node("Reshape", [x, f"{name}.blocks"], [f"{name}.xb"], name=f"{name}.reshape"),  # [B,S,K/32,32]
            helper.make_node(
                "ReduceSum", [f"{name}.xb", f"{name}.last_axis"], [f"{name}.xs"], name=f"{name}.blocksum", keepdims=0
            ),  # [B, S, K/32]
            helper.make_node("MatMul", [f"{name}.xs", f"{name}.mins"], [f"{name}.ym"], name=f"{name}.min_term"),
            helper.make_node("Add", [outs[0], f"{name}.ym"], [y], name=f"{name}.add_mins"),
        ]
    return nodes, inits


def quantize_lm_head(
    model: onnx.ModelProto,
    weight_input: str,
    table: np.ndarray,
    opts: Int4Options,
    pad_rows: bool = False,
    gguf: GgufProjections | None = None,
) -> onnx.ModelProto:
    """The final exit graph with its LM head as a constant, quantized to opts.lm_head bits: the GGUF's own blocks
    of it where `gguf` holds its table at those bits (models/gguf_blocks.py head_blocks: exactly, as the manifest's
    quantization records), else ORT's quantizer over `table`.

    The exit graph computes logits as MatMul(normed [N, H], weight [H, V]) with the weight a graph input (the shared
    table, stored transposed; `table` is it, [H, V]). The weight becomes a constant, which the quantizer then turns
    into MatMulNBits, and the input is removed from the graph.

    `pad_rows` (an artifact whose one-row calls are padded: ExportOptions.pads): MatMulNBits computes one row with
    other code than two or more (4 bits at accuracy level 4 on AVX2 CPUs, every width at level 0 or 1), so a draft's
    logits in a wide check would differ in the last bits from the one-row step's, and a near tie could pick another
    token. A zero row is appended to a one-row call's input and its logits cut off (where this CPU needs it: the
    segments' switch): every call multiplies >= 2 rows, and each row's logits are the same bit for bit whatever the
    call's width (tests/test_exact_wide.py).
    """
    import onnx
    from onnx import numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    users = [n for n in m.graph.node if weight_input in n.input]
    if len(users) != 1 or users[0].op_type != "MatMul" or list(users[0].input).index(weight_input) != 1:
        raise UsageError("--lm-head int4/int8 needs an exit graph whose LM head is one MatMul on the shared weight")
    keep = [i for i in m.graph.input if i.name != weight_input]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    from eectl.models.gguf_blocks import head_blocks

    blocks = head_blocks(gguf, opts)
    if blocks is not None:
        node = users[0]
        made, inits = _nbits_nodes(node.input[0], node.output[0], "lm_head", [blocks], opts.accuracy_level)
        at = list(m.graph.node).index(node)
        nodes = [*m.graph.node[:at], *made, *m.graph.node[at + 1 :]]
        del m.graph.node[:]
        m.graph.node.extend(nodes)
        m.graph.initializer.extend(inits)
        if pad_rows:
            _pad_head_rows(m, int(table.shape[0]))
        return m
    name = "lm_head.weight_hv"
    m.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(table.astype(np.float32)), name))
    users[0].input[1] = name
    users[0].name = users[0].name or "lm_head.matmul"
    bits = 8 if opts.lm_head == "int8" else 4
    q = quantize_graph(m, Int4Options(**{**asdict(opts), "keep_layers": (), "algorithm": "rtn"}), bits=bits)
    if pad_rows:
        _pad_head_rows(q, int(table.shape[0]))
    return q


def _pad_head_rows(m: onnx.ModelProto, hidden: int) -> None:
    """The LM head's MatMulNBits on its input plus one zero row where the call has one row, its output cut back to
    the input's rows. The padded segments' switch (export/graphs.py PAD_ROWS, [1]) says whether to: a runtime sets
    it to 0 where this CPU computes one row as two (runtime/sessions.py segment_options, runtime/rows.py); Min with
    the call's own row count keeps ORT from folding it before the session's value reaches it."""
    import onnx
    from onnx import helper, numpy_helper

    from eectl.export.graphs import PAD_ROWS

    g = m.graph
    (i,) = [k for k, n in enumerate(g.node) if n.op_type == "MatMulNBits"]
    node = g.node[i]
    x, y = node.input[0], node.output[0]
    g.initializer.extend(
        [
            numpy_helper.from_array(np.zeros((1, hidden), np.float32), "lm_head.pad_row"),
            numpy_helper.from_array(np.array([0], np.int64), "lm_head.zero"),
            numpy_helper.from_array(np.array([1], np.int64), "lm_head.one"),
            numpy_helper.from_array(np.array([1], np.int64), PAD_ROWS),
        ]
    )
    make = helper.make_node
    node.input[0], node.output[0] = f"{x}.padded", f"{y}.padded"
    before = [
        make("Shape", [x], ["lm_head.rows"], name="lm_head.rows", start=0, end=1),
        make("Equal", ["lm_head.rows", "lm_head.one"], ["lm_head.one_row"], name="lm_head.one_row"),
        make("Cast", ["lm_head.one_row"], ["lm_head.one_row_n"], name="lm_head.one_row_n", to=onnx.TensorProto.INT64),
        make("Min", ["lm_head.one_row_n", PAD_ROWS], ["lm_head.pads"], name="lm_head.pads"),
        make("Slice", ["lm_head.pad_row", "lm_head.zero", "lm_head.pads", "lm_head.zero"], ["lm_head.pad"]),
        make("Concat", [x, "lm_head.pad"], [f"{x}.padded"], name="lm_head.padded", axis=0),
    ]
    cut = make("Slice", [f"{y}.padded", "lm_head.zero", "lm_head.rows", "lm_head.zero"], [y], name="lm_head.cut")
    nodes = [*g.node[:i], *before, node, cut, *g.node[i + 1 :]]
    del g.node[:]
    g.node.extend(nodes)


def agreement_verdict(result: dict[str, Any], final_layer: int, floor: float) -> str | None:
    """Greedy agreement at the final exit (teacher-forced over the validation positions) against the floor.

    Adds `greedy_agreement` (per exit) to the validation result; returns a failure message or None.
    """
    positions = int(result["positions"])
    result["greedy_agreement"] = {
        k: round(1.0 - v / positions, 4) for k, v in result["greedy_token_mismatches"].items()
    }
    result["min_agreement"] = floor
    got = result["greedy_agreement"][str(final_layer)]
    if got < floor or not all(np.isfinite(v) for v in result["max_abs_logit_diff"].values()):
        return (
            f"{result.get('graphs', 'int4')} graphs agree with PyTorch on {got:.1%} of greedy tokens at the final "
            f"exit, below the floor "
            f"{floor:.0%} (max abs logit diff {result['max_abs_logit_diff'][str(final_layer)]:.3g})"
        )
    return None


@dataclass
class QuantSummary:
    """For reports: how many MatMuls became MatMulNBits in a graph."""

    quantized: int = 0
    kept: int = 0
    ops: dict[str, int] = field(default_factory=dict)


def summarise(model: onnx.ModelProto) -> QuantSummary:
    s = QuantSummary()
    for node in model.graph.node:
        s.ops[node.op_type] = s.ops.get(node.op_type, 0) + 1
    s.quantized = s.ops.get("MatMulNBits", 0)
    s.kept = s.ops.get("MatMul", 0)
    return s


def read_gguf_blocks(loaded: LoadedModel, log: Any = None) -> tuple[GgufProjections, dict[str, Any]]:
    """The GGUF's own blocks of the model's projections (models/gguf_blocks.py) and their check against the loaded
    weights (transformers' dequantization of the same file): equal bit for bit, or the export fails here."""
    from eectl.models.gguf_blocks import MODULES, gguf_file, head_check, read_projections, weight_check

    adapter = loaded.adapter
    path = gguf_file(loaded.source)
    assert path is not None  # Int4Options.resolved said gguf
    if log is not None:
        log.log(f"int4 weights: the GGUF's own blocks ({path.name}), not re-quantized")
    proj = read_projections(path, adapter.dims.num_heads, adapter.dims.num_kv_heads)

    def weight(layer: int, name: str) -> np.ndarray:
        parent, child = MODULES[name]
        return getattr(getattr(adapter.layers[layer], parent), child).weight.detach().float().cpu().numpy()

    check = weight_check(proj, weight)
    head = head_check(proj, adapter.lm_head.weight.detach().float().cpu().numpy())
    if head is not None:  # the LM head's table in the file (a quantized final head is made from it: head_blocks)
        check["lm_head"] = head
    if check["tensors_not_bit_equal"]:
        raise ModelLoadError(
            f"the GGUF's blocks of {path.name} differ from the loaded model's weights in "
            f"{check['tensors_not_bit_equal']} tensors (largest difference {check['max_abs_weight_diff']:.3g})",
            hint="export with --int4-from ort (the file's tensors map otherwise than eectl reads them)",
        )
    return proj, check
