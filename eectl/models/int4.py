"""The int4 twin of a loaded model, in torch: the model an int4 artifact (`eectl export --weights int4`) runs.

`to_int4_twin` replaces, in place, every weight that export hands to ONNX Runtime's MatMulNBits quantizer with the
dequantized values of what that quantizer makes of it: the decoder layers' projections (not those of `keep_layers`)
and, when the settings quantize it, the final LM head. The torch stages (profile, train-heads, calibrate) then fit
heads and thresholds against the int4 model's own final layer, the reference an int4 artifact's exits are verified
against, instead of the fp32 model's.

Quantized by ORT's own code, never a copy of it: each matrix goes through `MatMulNBitsQuantizer` as a one-MatMul
graph (RTN: ORT's C++ block quantizer; HQQ: its torch solver), and the MatMulNBits tensors it writes are dequantized
as that operator's contract defines: w = (q - zero_point) * scale per block of `block_size` input channels.

    export's segment graph (export/graphs.py _layer)     the twin (torch Linear, [out, in])
    x @ [q | k | v]      [H, q + k + v]  -> MatMulNBits    q_proj, k_proj, v_proj  <- rows of dequant([q | k | v]).T
    attn @ o             [q, H]          -> MatMulNBits    o_proj
    h @ [gate | up]      [H, 2 I]        -> MatMulNBits    gate_proj, up_proj
    act @ down           [I, H]          -> MatMulNBits    down_proj

The fused matrices are quantized as export quantizes them: RTN's blocks run along each output column on their own,
but HQQ's solver stops on an error over the whole matrix, so quantizing q, k and v apart would give other values.

At accuracy level 4 (the default) the kernel also quantizes its input: each row, per block of `block_size` input
channels, to int8 with the scale max|x| / 127 (rounded to nearest, ties to even), and multiplies the integers exactly.
The twin does the same to each quantized projection's input (`Int8Activations`, a forward pre-hook: the modules stay
the model's own), so its products are the kernel's up to float rounding (~1e-6 of them, tests/test_int4_twin.py) and
not the ~1e-2 a float input leaves; q, k and v quantize the same input as the fused node does.

What this module does not do: quantize graphs (export/quantize.py), or copy a model (the twin IS the loaded model,
changed in place; export must load its own fp32 model, since quantizing these dequantized weights again is not the
artifact's quantization). It does not know about exits: with a quantized final LM head (`lm_head` int8/int4) the
twin's one LM head is the quantized one at every layer, while an artifact's intermediate exits bind the shared fp32
table.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from eectl.errors import UsageError
from eectl.models.loading import LoadedModel

# One decoder layer's MatMuls in export's segment graphs: (module, its Linear children side by side, in this order)
_FUSED = (
    ("self_attn", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", ("o_proj",)),
    ("mlp", ("gate_proj", "up_proj")),
    ("mlp", ("down_proj",)),
)
_LM_HEAD_BITS = {"int8": 8, "int4": 4}


class Int4Settings(Protocol):
    """What the twin reads of the quantization settings: export's `Int4Options`, or an artifact's manifest
    `quantization` (eectl.contracts.manifest.Quantization). A protocol, so that models/ imports neither."""

    @property
    def block_size(self) -> int: ...
    @property
    def symmetric(self) -> bool: ...
    @property
    def algorithm(self) -> str: ...  # "rtn" | "hqq"
    @property
    def lm_head(self) -> str: ...  # "fp32" | "int8" | "int4"
    @property
    def keep_layers(self) -> Sequence[int]: ...
    @property
    def accuracy_level(self) -> int: ...  # 4: int8 activations (Int8Activations); 0-3: float inputs

    # also read where present: `source` (auto | gguf | ort; absent: ort): the GGUF's own blocks (to_gguf_twin)


@torch.no_grad()
def to_int4_twin(loaded: LoadedModel, settings: Int4Settings) -> LoadedModel:
    """Turn `loaded` (a float32 model, as loaded) into its int4 twin IN PLACE and return it.

    Every decoder layer's q/k/v/o/gate/up/down weight, except in `settings.keep_layers`, becomes the dequantized
    int4 value ORT's quantizer gives for it (biases, norms and the embedding stay); with `settings.lm_head` int8 or
    int4 the LM head becomes a new parameter of the quantized values (the embedding keeps the fp32 table, tied or
    not). At accuracy level 4 each of those projections quantizes its input to int8 as the kernel does
    (`Int8Activations`). Call it once, on a freshly loaded model: its weights are then no longer the checkpoint's.
    """
    adapter = loaded.adapter
    L = adapter.num_layers
    if settings.algorithm not in ("rtn", "hqq") and getattr(settings, "source", "ort") != "gguf":
        raise UsageError(f"the int4 twin quantizes with rtn or hqq, got '{settings.algorithm}'")
    if settings.lm_head not in ("fp32", *_LM_HEAD_BITS):
        raise UsageError(f"the int4 twin's LM head is fp32, int8 or int4, got '{settings.lm_head}'")
    if bad := [i for i in settings.keep_layers if not 0 <= i < L]:
        raise UsageError(f"int4 kept layers {bad} are outside 0..{L - 1}")
    if adapter.dtype != torch.float32:
        raise UsageError(
            f"the int4 twin quantizes the float32 weights, as export does; this model is loaded as {adapter.dtype}",
            hint="load the model in float32 and make the twin before any cast or move",
        )
    int8_inputs = getattr(settings, "accuracy_level", 0) == INT8_LEVEL
    from eectl.models.gguf_blocks import int4_source

    head_done = False
    if int4_source(settings, loaded.source) == "gguf":
        head_done = to_gguf_twin(loaded, settings).get("lm_head_from_file", False)
    else:
        _ort_layers(loaded, settings, int8_inputs)
    if settings.lm_head != "fp32" and not head_done:
        head = adapter.lm_head
        table = head.weight.T.cpu().numpy()  # [H, V], as export's final exit graph holds it
        # export quantizes the head with RTN whatever the layers' algorithm (export/quantize.py quantize_lm_head)
        table_q = ort_int4_dequantized(table, settings, bits=_LM_HEAD_BITS[settings.lm_head], algorithm="rtn")
        # a new parameter, not a copy into the old one: a tied embedding keeps the fp32 table
        weight = torch.from_numpy(np.ascontiguousarray(table_q.T)).to(head.weight.device)
        head.weight = torch.nn.Parameter(weight, requires_grad=False)
        if int8_inputs:  # export's head node carries the same accuracy level
            head.register_forward_pre_hook(Int8Activations(settings.block_size))
    return loaded


def _ort_layers(loaded: LoadedModel, settings: Int4Settings, int8_inputs: bool) -> None:
    """The decoder projections as ORT's quantizer makes them (export --int4-from ort)."""
    adapter = loaded.adapter
    for i in range(adapter.num_layers):
        if i in settings.keep_layers:
            continue
        layer = adapter.layers[i]
        for parent, names in _FUSED:
            linears = [getattr(getattr(layer, parent), n) for n in names]
            fused = torch.cat([lin.weight.T for lin in linears], dim=1)  # [in, sum of out]: the MatMul's weight
            deq = torch.from_numpy(ort_int4_dequantized(fused.cpu().numpy(), settings))
            start = 0
            for lin in linears:
                out = lin.weight.shape[0]
                lin.weight.copy_(deq[:, start : start + out].T)
                start += out
                if int8_inputs:
                    lin.register_forward_pre_hook(Int8Activations(settings.block_size))


def to_gguf_twin(loaded: LoadedModel, settings: Int4Settings) -> dict[str, Any]:
    """The decoder projections as export --int4-from gguf runs them (models/gguf_blocks.py): the weights stay the
    loaded ones, which are the file's dequantized blocks (checked bit for bit: a mismatch is a mapping bug and
    fails); where a block has a min, the Linear's weight becomes MatMulNBits' part (q - zero point) * scale and a
    forward hook adds the min term BlockSum_32(x) @ mins in float32 (`BlockMins`), on the unquantized input as the
    graph computes it; at accuracy level 4 the MatMulNBits part's input is quantized to int8 per block of the
    tensor's own block size (32, or 16 for Q6_K). Projections of types not held, and the kept layers, stay fp32.
    A quantized final head made from the file's table (gguf_blocks.head_blocks) is treated the same way, as a new
    parameter (a tied embedding keeps its table). Returns the weight check (gguf_blocks.weight_check), with
    `lm_head_from_file` True where the head was made so."""
    from eectl.models.gguf_blocks import MODULES, gguf_file, head_blocks, head_check, read_projections, weight_check

    adapter = loaded.adapter
    path = gguf_file(loaded.source)
    assert path is not None  # int4_source said gguf
    dims = adapter.dims
    proj = read_projections(path, dims.num_heads, dims.num_kv_heads)

    def linear(layer: int, name: str) -> torch.nn.Linear:
        parent, child = MODULES[name]
        lin: torch.nn.Linear = getattr(getattr(adapter.layers[layer], parent), child)
        return lin

    check = weight_check(proj, lambda layer, name: linear(layer, name).weight.detach().cpu().numpy())
    if check["tensors_not_bit_equal"]:
        raise UsageError(
            f"the GGUF's blocks of {proj.path.name} differ from the loaded model's weights in "
            f"{check['tensors_not_bit_equal']} tensors (largest difference {check['max_abs_weight_diff']:.3g})",
            hint="pass --int4-from ort (and report the model: its tensors map otherwise than eectl reads them)",
        )
    level4 = getattr(settings, "accuracy_level", 0) == INT8_LEVEL
    for (layer, name), w in proj.parts.items():
        if layer not in settings.keep_layers:
            _as_blocks(linear(layer, name), w, level4)
    head_check(proj, adapter.lm_head.weight.detach().cpu().numpy())
    head = head_blocks(proj, settings)
    if head is not None:
        lm = adapter.lm_head
        lm.weight = torch.nn.Parameter(lm.weight.detach().clone(), requires_grad=False)  # untied from the embedding
        _as_blocks(lm, head, level4)
    return {**check, "lm_head_from_file": head is not None}


def _as_blocks(lin: torch.nn.Linear, w: Any, level4: bool) -> None:
    """A Linear holding the file's blocks `w` (gguf_blocks.NBitsWeight) computing as export's MatMulNBits nodes do:
    its weight MatMulNBits' part and the min term added by hooks where the blocks have mins, its input quantized to
    int8 per block at level 4."""
    mins = None
    if w.mins is not None:
        lin.weight.copy_(torch.from_numpy(w.matmulnbits_part().T))
        mins = torch.from_numpy(w.mins).to(lin.weight.device)
    if mins is not None or level4:
        hook = BlockMins(mins, w.block if level4 else None)
        lin.register_forward_pre_hook(hook.before)
        if mins is not None:
            lin.register_forward_hook(hook.after)


class BlockMins:
    """A Linear's hooks for a GGUF tensor with per-block mins: `before` keeps the input and (int8_block: the level
    4 kernel's) quantizes it as MatMulNBits does; `after` adds BlockSum_32(input) @ mins [K/32, N] to the output,
    the graph's min term (export/quantize.py gguf_graph). The input is kept between the two calls of one forward."""

    def __init__(self, mins: torch.Tensor | None, int8_block: int | None) -> None:
        self.mins = mins
        self.int8_block = int8_block
        self._x: torch.Tensor | None = None

    def before(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        x = args[0]
        if self.mins is not None:
            self._x = x
        if self.int8_block is None:
            return None
        return (int8_blocks(x, self.int8_block), *args[1:])

    def after(self, module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        x, self._x = self._x, None
        assert x is not None and self.mins is not None
        sums = x.reshape(*x.shape[:-1], -1, 32).sum(dim=-1)  # [..., K/32]
        return output + sums @ self.mins


INT8_LEVEL = 4  # MatMulNBits' accuracy level whose kernel quantizes its input to int8 (CompInt8)


class Int8Activations:
    """A Linear's forward pre-hook: its input as MatMulNBits at accuracy level 4 sees it (`int8_blocks`)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (int8_blocks(args[0], self.block_size), *args[1:])


def int8_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [..., K] with each row quantized to int8 per block of `block_size` channels and dequantized, as ORT's CPU
    kernel quantizes MatMulNBits' input at accuracy level 4 (MLAS QuantizeARow_CompInt8): scale = max|block| / 127,
    q = round(x * (127 / max|block|)) (ties to even; an all-zero block stays zero); a last partial block is padded
    with zeros. Float32, as the kernel."""
    K = x.shape[-1]
    pad = -K % block_size
    xb = torch.nn.functional.pad(x, (0, pad)) if pad else x
    xb = xb.reshape(*x.shape[:-1], -1, block_size)
    peak = xb.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(peak > 0, 127.0 / torch.where(peak > 0, peak, 1.0), 0.0)
    q = torch.round(xb * inverse)
    return (q * (peak / 127.0)).reshape(*x.shape[:-1], -1)[..., :K]


def ort_int4_dequantized(
    weight: np.ndarray, settings: Int4Settings, bits: int = 4, algorithm: str | None = None
) -> np.ndarray:
    """A MatMul weight [K, N] (ONNX layout: input channels first) through ORT's MatMulNBits quantizer with these
    settings (`bits` and `algorithm` override theirs), dequantized back to float32 [K, N]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        HQQWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    w = np.ascontiguousarray(weight, dtype=np.float32)
    K, N = w.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="w.matmul")],
        "one_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    config: Any  # the same configuration export/quantize.py gives the quantizer (accuracy_level: no effect on weights)
    if (algorithm or settings.algorithm) == "hqq" and bits == 4:
        config = HQQWeightOnlyQuantConfig(block_size=settings.block_size, bits=4)
    else:
        config = DefaultWeightOnlyQuantConfig(
            block_size=settings.block_size, is_symmetric=settings.symmetric, bits=bits
        )
    q = MatMulNBitsQuantizer(model, algo_config=config)
    with warnings.catch_warnings():  # ORT's HQQ path wraps a read-only array in a tensor (it only reads it)
        warnings.simplefilter("ignore", UserWarning)
        q.process()
    out: onnx.ModelProto = q.model.model
    node = next(n for n in out.graph.node if n.op_type == "MatMulNBits")
    tensors = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    zero_points = tensors[node.input[3]] if len(node.input) > 3 and node.input[3] else None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return dequantize_matmulnbits(tensors[node.input[1]], tensors[node.input[2]], zero_points, attrs)


def dequantize_matmulnbits(
    packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, attrs: dict[str, Any]
) -> np.ndarray:
    """com.microsoft::MatMulNBits' weight as float32 [K, N], from its inputs B, scales, zero_points and attributes
    K, N, bits, block_size (the operator's contract: per column n and block b of `block_size` input channels,
    w = (q - zero_point) * scale; packed values low bits first; no zero points means 2^(bits - 1))."""
    K, N, bits, block = (int(attrs[k]) for k in ("K", "N", "bits", "block_size"))
    if bits not in (4, 8):
        raise ValueError(f"MatMulNBits with {bits} bits: only 4 and 8 are dequantized here")
    blocks = -(-K // block)
    q = _unpack(packed.reshape(N, -1), bits)[:, : blocks * block].reshape(N, blocks, block)
    scale = scales.reshape(N, blocks, 1).astype(np.float32)
    qf = q.astype(np.float32)
    # rounded as ORT's CPU kernel rounds (bit for bit at accuracy level 0, tests/test_int4_twin.py): integer zero
    # points are subtracted first, float ones (HQQ) scaled first
    if zero_points is None:
        w = (qf - np.float32(2 ** (bits - 1))) * scale  # [N, blocks, block]
    elif np.issubdtype(zero_points.dtype, np.floating):  # HQQ: one float zero point per block
        w = qf * scale - zero_points.reshape(N, blocks, 1).astype(np.float32) * scale
    else:  # packed like B, each column's row padded to whole bytes
        zp = _unpack(zero_points.reshape(N, -1), bits)[:, :blocks].astype(np.float32)
        w = (qf - zp[..., None]) * scale
    return np.ascontiguousarray(w.reshape(N, blocks * block)[:, :K].T)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """[rows, bytes] uint8 -> [rows, bytes * 8 / bits] values, the low bits of each byte first."""
    if bits == 8:
        return packed
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
