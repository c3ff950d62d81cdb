"""A GGUF file's own quantized blocks as ONNX Runtime MatMulNBits weights, exactly (`export --int4-from gguf`).

`eectl export --weights int4` re-quantizes the fp32 weights with ORT's quantizer; for a model loaded from a GGUF
those fp32 weights are the file's dequantized blocks, so that quantizes them a second time. This module reads the
blocks themselves and re-expresses each projection as `com.microsoft::MatMulNBits` inputs whose dequantized values
are the file's dequantized values bit for bit (the fp32 weights transformers' GGUF loader gives the model, which is
gguf-py's `dequantize`):

    GGUF type  block   what the file holds            MatMulNBits                           + min term
    Q4_0       32      w = d (q - 8)                  bits 4, block 32, scale d, zp 8       -
    Q4_1       32      w = d q + m                    bits 4, block 32, scale d, zp z       m + d z
    Q5_0       32      w = d (q - 16), q 5-bit        bits 8, block 32, scale d, zp 16      -
    Q5_1       32      w = d q + m, q 5-bit           bits 8, block 32, scale d, zp z       m + d z
    Q8_0       32      w = d q, q int8                bits 8, block 32, scale d, zp 128     -
    Q4_K       256     8 x 32: w = (d sc) q - dmin mn bits 4, block 32, scale d sc, zp z    d sc z - dmin mn
    Q6_K       256     16 x 16: w = (d sc)(q - 32)    bits 8, block 16, scale d sc, zp 32   -

fp16 scales and mins widen to fp32 exactly, and the products d sc, dmin mn and scale (q - zp) are exact in fp32 (at
most 11 + 8 + 8 significant bits), so every type above is held exactly. A per-block additive min is not an integer
zero point: its whole steps go into the zero point, z = round(-min / scale) within the zero point's range (where
every weight of the block stays bit for bit: `_absorb_mins`), and the rest is added as llama.cpp adds a min:
y = MatMulNBits(x) + BlockSum_32(x) @ mins, with mins a [K/32, N] table (the sum of x over each block of 32 input
channels, times the block's rest, at most half a step where z fits). Other types (Q2_K, Q3_K,
Q5_K, the IQ types, F16/BF16) are not read here (`HELD` lists what is): their projections stay fp32 in the artifact.

The GGUF stores a weight as rows of output channels, each row its input channels in blocks: MatMulNBits' own layout
(B [N, K / block, block bytes]), so a tensor's rows map to the operator's columns without a transpose. Llama GGUFs
hold attn_q/attn_k with llama.cpp's rotary permutation of the rows; transformers undoes it on load, and so does
`read_projections` (on whole rows: the blocks run along a row). Fused projections (q|k|v, gate|up: export's graphs
concatenate them into one MatMul) are concatenated along N; parts of different formats stay separate groups.

What this module does not do: build or rewrite graphs (export/quantize.py), or check the mapping against a loaded
model (export and the int4 twin compare `dequantized()` with the model's weights, which must be equal bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MIN_BLOCK = 32  # the block of the min term (Q4_1, Q5_1, Q4_K sub-blocks)
HELD = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K")
# the LM head's table in a GGUF: its own, else the token embedding it is tied to (rows: the vocabulary)
HEAD_TENSORS = ("output.weight", "token_embd.weight")
# eectl's fused MatMuls (export/graphs.py _layer: the initializer `layers.{i}.{name}`) and their GGUF tensors
FUSED = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}
# ... and the same projections as the transformers modules the twin changes
MODULES = {
    "attn_q": ("self_attn", "q_proj"),
    "attn_k": ("self_attn", "k_proj"),
    "attn_v": ("self_attn", "v_proj"),
    "attn_output": ("self_attn", "o_proj"),
    "ffn_gate": ("mlp", "gate_proj"),
    "ffn_up": ("mlp", "up_proj"),
    "ffn_down": ("mlp", "down_proj"),
}


@dataclass
class NBitsWeight:
    """A MatMul weight [K, N] (ONNX layout) as MatMulNBits inputs, plus an optional min term.

    Values are held unpacked (one uint8 per weight); `packed()` and `packed_zero_points()` give the operator's bytes.
    """

    bits: int  # 4 or 8
    block: int  # input channels per scale
    q: np.ndarray  # [N, K] uint8, each in 0 .. 2^bits - 1
    scales: np.ndarray  # [N, K / block] float32
    zero_points: np.ndarray  # [N, K / block] uint8
    mins: np.ndarray | None  # [K / MIN_BLOCK, N] float32, added as BlockSum_32(x) @ mins; None: no min term
    types: dict[str, int] = field(default_factory=dict)  # GGUF tensor types it came from, counted

    @property
    def K(self) -> int:
        return int(self.q.shape[1])

    @property
    def N(self) -> int:
        return int(self.q.shape[0])

    def matmulnbits_part(self) -> np.ndarray:
        """[K, N] float32: what MatMulNBits alone dequantizes to, (q - zero_point) * scale per block."""
        N, K, blocks = self.N, self.K, self.K // self.block
        q = self.q.reshape(N, blocks, self.block).astype(np.float32)
        w = (q - self.zero_points.reshape(N, blocks, 1).astype(np.float32)) * self.scales.reshape(N, blocks, 1)
        return np.ascontiguousarray(w.reshape(N, K).T)

    def dequantized(self) -> np.ndarray:
        """[K, N] float32: the weight the graph computes with (MatMulNBits' part plus each block's min), in the
        order gguf-py dequantizes (scale * q, then + min): equal to the file's dequantized values bit for bit."""
        w = self.matmulnbits_part()
        if self.mins is not None:
            w = w + np.repeat(self.mins, MIN_BLOCK, axis=0)
        return w

    def packed(self) -> np.ndarray:
        """B [N, K / block, block * bits / 8] uint8, low bits first."""
        N, blocks = self.N, self.K // self.block
        q = self.q.reshape(N, blocks, self.block)
        if self.bits == 8:
            return np.ascontiguousarray(q)
        return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4))

    def packed_zero_points(self) -> np.ndarray:
        """zero_points as MatMulNBits takes them: [N * ceil(blocks * bits / 8)] uint8, each row padded to bytes."""
        if self.bits == 8:
            return np.ascontiguousarray(self.zero_points.reshape(-1))
        zp = self.zero_points
        if zp.shape[1] % 2:
            zp = np.concatenate([zp, np.zeros((zp.shape[0], 1), np.uint8)], axis=1)
        return np.ascontiguousarray((zp[:, 0::2] | (zp[:, 1::2] << 4)).reshape(-1))

    def rows(self, order: np.ndarray) -> NBitsWeight:
        """The same weight with its output channels (columns of [K, N]) taken in `order`."""
        return NBitsWeight(
            self.bits,
            self.block,
            self.q[order],
            self.scales[order],
            self.zero_points[order],
            None if self.mins is None else self.mins[:, order],
            dict(self.types),
        )


def concat(parts: list[NBitsWeight]) -> NBitsWeight:
    """Weights with the same bits and block side by side along N (a fused MatMul); a part without mins gets zeros."""
    first = parts[0]
    if any((p.bits, p.block, p.K) != (first.bits, first.block, first.K) for p in parts):
        raise ValueError("only weights of one bit width, block size and K concatenate into one MatMulNBits")
    mins = None
    if any(p.mins is not None for p in parts):
        mins = np.concatenate(
            [p.mins if p.mins is not None else np.zeros((p.K // MIN_BLOCK, p.N), np.float32) for p in parts], axis=1
        )
    types: dict[str, int] = {}
    for p in parts:
        for t, n in p.types.items():
            types[t] = types.get(t, 0) + n
    return NBitsWeight(
        first.bits,
        first.block,
        np.concatenate([p.q for p in parts]),
        np.concatenate([p.scales for p in parts]),
        np.concatenate([p.zero_points for p in parts]),
        mins,
        types,
    )


def groups(parts: list[NBitsWeight]) -> list[NBitsWeight]:
    """Consecutive parts of one format merged (`concat`): the MatMulNBits nodes a fused MatMul becomes."""
    out: list[list[NBitsWeight]] = []
    for p in parts:
        if out and (out[-1][0].bits, out[-1][0].block) == (p.bits, p.block):
            out[-1].append(p)
        else:
            out.append([p])
    return [concat(g) for g in out]


def _f16(raw: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 -> [n] float32 (an fp16 per row, widened exactly)."""
    return np.ascontiguousarray(raw).view(np.float16).reshape(-1).astype(np.float32)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """[n, bytes] -> [n, 2 * bytes]: per run of `group` bytes, the low nibbles, then the high ones (ggml's order)."""
    n = qs.shape[0]
    x = qs.reshape(n, -1, 1, group) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (x & np.uint8(0x0F)).reshape(n, -1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 fifth bits (4 bytes, little-endian bit j for element j) -> [n, 32] values 0 or 16."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")
    return (bits << 4).astype(np.uint8)


def from_blocks(data: np.ndarray, type_name: str) -> NBitsWeight:
    """One GGUF tensor of `type_name` ([rows, bytes per row] uint8, rows = output channels) as an NBitsWeight
    (its [K, N] = the tensor's transposed [rows, K])."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if type_name not in HELD:
        raise ValueError(f"GGUF type {type_name} is not held as MatMulNBits (held: {', '.join(HELD)})")
    block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    N = data.shape[0]
    K = data.shape[1] // block_bytes * block_elems
    b = np.ascontiguousarray(data).reshape(-1, block_bytes)  # every block of the tensor, row by row
    mins = None
    if type_name == "Q4_0":
        bits, block, scale, q, zp = 4, 32, _f16(b[:, :2]), _nibbles(b[:, 2:], 16), 8
    elif type_name == "Q4_1":
        bits, block, scale, q, zp = 4, 32, _f16(b[:, :2]), _nibbles(b[:, 4:], 16), 0
        mins = _f16(b[:, 2:4])
    elif type_name == "Q5_0":
        bits, block, scale, zp = 8, 32, _f16(b[:, :2]), 16
        q = _nibbles(b[:, 6:], 16) | _high_bits(b[:, 2:6])
    elif type_name == "Q5_1":
        bits, block, scale, zp = 8, 32, _f16(b[:, :2]), 0
        mins = _f16(b[:, 2:4])
        q = _nibbles(b[:, 8:], 16) | _high_bits(b[:, 4:8])
    elif type_name == "Q8_0":
        bits, block, scale, zp = 8, 32, _f16(b[:, :2]), 128
        q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    elif type_name == "Q4_K":
        from gguf.quants import Q4_K

        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = Q4_K.get_scale_min(b[:, 4 : 4 + Q4_K.K_SCALE_SIZE])  # [blocks, 8] each, 6-bit
        bits, block, zp = 4, 32, 0
        scale = (d[:, None] * sc.astype(np.float32)).reshape(-1)  # exact: 11 x 6 bits
        mins = (-(dmin[:, None] * mn.astype(np.float32))).reshape(-1)
        q = _nibbles(b[:, 4 + Q4_K.K_SCALE_SIZE :], 32)
    else:  # Q6_K: ql (128 bytes), qh (64), int8 scales (16), d (fp16)
        ql, qh, sc8, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(0x03)
        q = low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << np.uint8(4))
        bits, block, zp = 8, 16, 32
        scale = (d[:, None] * sc8.view(np.int8).astype(np.float32)).reshape(-1)  # exact: 11 x 8 bits
    blocks = K // block
    q = np.ascontiguousarray(q, dtype=np.uint8).reshape(N, K)
    scales = np.ascontiguousarray(scale, dtype=np.float32).reshape(N, blocks)
    zero_points = np.full((N, blocks), zp, np.uint8)
    if mins is not None:  # the min's whole steps go into the zero point (block == MIN_BLOCK for every such type)
        zero_points, mins = _absorb_mins(q.reshape(N, blocks, block), scales, mins.reshape(N, blocks), bits)
    table = None if mins is None else np.ascontiguousarray(mins.reshape(N, K // MIN_BLOCK).T, dtype=np.float32)
    return NBitsWeight(bits, block, q, scales, zero_points, table, {type_name: 1})


def _absorb_mins(q: np.ndarray, scales: np.ndarray, mins: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """w = d q + m as d (q - z) + (m + d z), z = round(-m / d) clipped to the zero point's range: the same weights,
    with the kernel's part centred on the block and the min term only the rest (|m + d z| <= d / 2 where z fits).
    q [N, blocks, block] uint8, scales and mins [N, blocks]; returns zero points [N, blocks] and the rest, flat.

    Why: at accuracy level 4 the kernel multiplies int8-rounded activations by (q - z); the min term is added on the
    unrounded input. With z = 0 the rounding error meets weights shifted by the min (all of one sign in a block) and
    is not cancelled by the min term; centred, it meets weights of the size of w, as in llama.cpp (whose Q4_1 x Q8_1
    product adds the min on the rounded activations' sum). A block keeps z = 0 unless every one of its weights comes
    out bit for bit as d q + m does in float32 (export checks the whole tensor again)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(scales > 0, np.rint(-mins / scales), 0.0)
    z = np.clip(z, 0, (1 << bits) - 1).astype(np.float32)  # [N, blocks]
    rest = (mins + scales * z).astype(np.float32)
    qf = q.astype(np.float32)
    was = scales[..., None] * qf + mins[..., None]
    now = scales[..., None] * (qf - z[..., None]) + rest[..., None]
    same = (was == now).all(axis=-1)
    z = np.where(same, z, 0.0).astype(np.uint8)
    rest = np.where(same, rest, mins).astype(np.float32)
    return z, rest.reshape(-1)


def _unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """The row order transformers' GGUF loader gives llama's attn_q/attn_k (LlamaTensorProcessor
    _reverse_permute_weights: undoing llama.cpp's rotary permutation)."""
    idx = np.arange(n_rows)
    return idx.reshape(n_head, n_rows // n_head // 2, 2).swapaxes(2, 1).reshape(-1)


@dataclass
class GgufProjections:
    """A GGUF file's decoder projections as eectl's fused MatMuls: `fused[(layer, name)]` is the list of
    MatMulNBits groups of `layers.{layer}.{name}` (name in FUSED), or absent where a part's type is not held."""

    path: Path
    architecture: str
    fused: dict[tuple[int, str], list[NBitsWeight]]
    parts: dict[tuple[int, str], NBitsWeight]  # (layer, GGUF projection name): for the twin, per Linear
    types: dict[str, int]  # every projection tensor's type, counted (held or not)
    not_held: dict[str, int]  # the types counted above that stay fp32
    head: NBitsWeight | None = None  # the LM head's table (HEAD_TENSORS) where its type is held, [K = H, N = V]
    head_type: str | None = None  # its GGUF type, held or not (None: the file has neither tensor)

    def record(self) -> dict[str, Any]:
        """For the manifest's quantization field."""
        return {
            "source": "gguf",
            "gguf_types": dict(sorted(self.types.items())),
            "gguf_not_held": dict(sorted(self.not_held.items())),
        }


def projection_types(path: Path) -> dict[str, int]:
    """The types of a GGUF file's decoder projection tensors, counted (reads the header only)."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        if t.name.startswith("blk.") and t.name.split(".")[2] in MODULES:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def has_held_blocks(path: Path) -> bool:
    """Whether a GGUF file's projections are (mostly) quantized blocks eectl holds exactly (`HELD`): what
    `--int4-from auto` reads from the file. llama.cpp's Q4_K_M of a model whose rows are not a multiple of 256 (576,
    640, 896 wide: SmolLM2, Gemma 3 270M, Qwen2.5 0.5B) is mostly Q5_0 and Q8_0 with some Q4_K and Q6_K; those are
    held (as 8-bit where the file is wider than 4 bits), where re-quantizing them to int4 would make a worse copy."""
    types = projection_types(path)
    held = sum(n for t, n in types.items() if t in HELD)
    return held > 0 and held * 2 >= sum(types.values())


def read_projections(path: Path, num_heads: int, num_kv_heads: int) -> GgufProjections:
    """Every decoder layer's projections of the GGUF at `path`, as MatMulNBits weights in the row order the
    transformers-loaded model has them."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    parts: dict[tuple[int, str], NBitsWeight] = {}
    types: dict[str, int] = {}
    not_held: dict[str, int] = {}
    heads = {t.name: t for t in reader.tensors if t.name in HEAD_TENSORS}
    head_tensor = next((heads[n] for n in HEAD_TENSORS if n in heads), None)
    head_type = None if head_tensor is None else head_tensor.tensor_type.name
    head = from_blocks(np.asarray(head_tensor.data), head_type) if head_tensor and head_type in HELD else None
    for t in reader.tensors:
        pieces = t.name.split(".")
        if len(pieces) != 4 or pieces[0] != "blk" or pieces[2] not in MODULES or pieces[3] != "weight":
            continue
        kind = t.tensor_type.name
        types[kind] = types.get(kind, 0) + 1
        if kind not in HELD:
            not_held[kind] = not_held.get(kind, 0) + 1
            continue
        w = from_blocks(np.asarray(t.data), kind)
        if arch == "llama" and pieces[2] in ("attn_q", "attn_k"):  # as LlamaTensorProcessor undoes it
            w = w.rows(_unpermute_rows(w.N, num_heads if pieces[2] == "attn_q" else num_kv_heads))
        parts[(int(pieces[1]), pieces[2])] = w
    layers = sorted({layer for layer, _ in parts})
    fused = {}
    for layer in layers:
        for name, members in FUSED.items():
            if all((layer, m) in parts for m in members):
                fused[(layer, name)] = groups([parts[(layer, m)] for m in members])
    return GgufProjections(path, arch, fused, parts, types, not_held, head, head_type)


def head_blocks(proj: GgufProjections | None, settings: Any) -> NBitsWeight | None:
    """The file's own blocks of the LM head where a quantized final head (`settings.lm_head` int8/int4, export's
    Int4Options or a manifest's quantization) is made from them: the segments come from the file (`proj`), its
    head tensor is held, and its bits and block are the ones asked (Q8_0 for int8, Q4_0/Q4_1/Q4_K for int4, blocks
    of `settings.block_size`); else None, and ORT's quantizer re-quantizes the dequantized table. A manifest
    records the choice (`lm_head_source`), and one recorded "ort" is kept."""
    asked = {"int8": 8, "int4": 4}.get(getattr(settings, "lm_head", "fp32"))
    if proj is None or proj.head is None or asked is None or getattr(settings, "lm_head_source", "auto") == "ort":
        return None
    return proj.head if (proj.head.bits, proj.head.block) == (asked, settings.block_size) else None


# The int4 settings that shape ORT's quantizer (their flag, their default): given away from the default, `auto`
# takes ORT's quantizer, and `gguf` refuses them (they mean nothing for the file's blocks)
QUANTIZER_SETTINGS = {
    "algorithm": ("--int4-algorithm", "rtn"),
    "symmetric": ("--int4-symmetric", False),
    "block_size": ("--int4-block-size", 32),
}


def quantizer_flags(settings: Any) -> list[str]:
    """The flags of ORT's quantizer that `settings` (export's Int4Options, a recipe's int4, a manifest's
    quantization) sets away from their defaults."""
    return [flag for name, (flag, default) in QUANTIZER_SETTINGS.items() if getattr(settings, name) != default]


def gguf_file(source: Any) -> Path | None:
    """The GGUF file a model was loaded from (models/loading.py ModelSource), or None."""
    return source.path if source.kind in ("default", "gguf") and source.path is not None else None


def int4_source(settings: Any, source: Any) -> str:
    """Where int4 weights of the model loaded from `source` (a ModelSource) come from under `settings`: "gguf" (the
    file's own blocks) or "ort" (ORT's quantizer). `settings.source` auto: gguf where the model is a GGUF with 4-bit
    blocks and no quantizer setting is given; a manifest's recorded source is taken as it is."""
    from eectl.errors import UsageError

    asked = getattr(settings, "source", "ort")
    path = gguf_file(source)
    held = path is not None and has_held_blocks(path)
    if asked == "gguf" and not held:
        raise UsageError(
            "--int4-from gguf needs a model loaded from a GGUF file whose projections are quantized blocks eectl "
            f"holds ({', '.join(HELD)})",
            hint="pass --int4-from ort to quantize the fp32 weights with ONNX Runtime's quantizer",
        )
    if asked == "auto":
        return "gguf" if held and not quantizer_flags(settings) else "ort"
    return str(asked)


def head_check(proj: GgufProjections, lm_weight: np.ndarray) -> dict[str, Any] | None:
    """The file's head blocks against the loaded model's LM head weight ([V, H] float32 numpy): where they are not
    its values bit for bit (another mapping than eectl reads), `proj.head` is dropped (a quantized head is then
    re-quantized by ORT's quantizer) and the result says so. None where the file's head is not held."""
    if proj.head is None:
        return None
    mine = proj.head.dequantized().T
    equal = mine.shape == lm_weight.shape and np.array_equal(mine.view(np.uint32), lm_weight.view(np.uint32))
    worst = float(np.abs(mine - lm_weight).max()) if mine.shape == lm_weight.shape else float("inf")
    if not equal:
        proj.head = None
    return {"gguf_type": proj.head_type, "max_abs_weight_diff": worst, "bit_equal": equal}


def weight_check(proj: GgufProjections, weight_of: Any) -> dict[str, Any]:
    """The largest difference between what the MatMulNBits weights (plus mins) dequantize to and the loaded model's
    weights (`weight_of(layer, gguf name)`: [out, in] float32 numpy), which are transformers' dequantization of
    the same file: 0 where the blocks are held exactly and mapped to the right parameters."""
    worst = 0.0
    unequal = 0
    for (layer, name), w in proj.parts.items():
        mine = w.dequantized().T
        theirs = weight_of(layer, name)
        if mine.shape != theirs.shape:
            raise ValueError(f"blk.{layer}.{name}: GGUF blocks {mine.shape} vs the model's weight {theirs.shape}")
        worst = max(worst, float(np.abs(mine - theirs).max()))
        unequal += int(not np.array_equal(mine.view(np.uint32), theirs.view(np.uint32)))
    return {
        "source": "gguf",
        "file": proj.path.name,
        "tensors": len(proj.parts),
        "gguf_types": dict(sorted(proj.types.items())),
        "not_held": dict(sorted(proj.not_held.items())),
        "max_abs_weight_diff": worst,
        "tensors_not_bit_equal": unequal,
    }
