"""Candidate sources: how the first exit a token reaches picks its K candidates (its local vocabulary, the LM-head
rows every later exit scores with `ExitHead.local`).

A module of their own because a source is more than a name in exits/signals.py's scoring path: it carries per-model data
(a shortlist's ids, an int8 copy of the LM head) and a torch computation that export rebuilds as the exit's
candidate graph from the same tensors (export_graphs.build_candidates). exits.ExitScoring is the one caller of
`pick`, so calibrate and the runner pick with the same source and a threshold means the same thing at run time.

What this module does not do: score signals or decide exits (exits/signals.py), or build graphs (export/graphs.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from eectl.contracts.names import CANDIDATE_SOURCE_NAMES
from eectl.errors import UsageError
from eectl.exits.base import CandidateSource

if TYPE_CHECKING:
    from eectl.exits.base import Array, ExitHead, ExitLogits, ExitState


class FirstExitTopK(CandidateSource):
    """FlexEE: one full LM-head projection at the first exit; its K best logits are the candidates."""

    name = "first-exit-topk"

    def pick(self, logits: ExitLogits, layer: int, state: ExitState, k: int) -> tuple[Array, Array]:
        return logits.full_topk(layer, state.hidden, k)

    def torch_pick(self, head: ExitHead, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        top = torch.topk(head.full(hidden), k, dim=-1)
        return top.indices, top.values


# ---------------------------------------------------------------------------------------------------------------
# Candidate sources: how the first active exit picks the token's K-candidate local vocabulary
# ---------------------------------------------------------------------------------------------------------------
#
# The full LM head is V x H (49,152 x 576 on the default model: ~7 decoder layers of memory traffic per token), so
# projecting it once per token at the first exit costs more than most exits save. A candidate source picks the K
# candidates for less; the K candidate logits are always the exact rows of the LM head (what later exits score
# too), and a token that reaches the final layer still gets the exact full LM head (runtime/).
#
# - first-exit-topk: the full LM head, Top-K (FlexEE; the exact reference).
# - shortlist: only S rows of the LM head, the S most frequent tokens of the calibration data and of the model's
#              own greedy generations (FR-Spec, VocabTrim); Top-K among them. A token whose final prediction is
#              outside the shortlist cannot exit (its exits predict a shortlist token, which disagrees).
# - int8:      the whole vocabulary ranked by an int8 copy of the LM head (symmetric per-row weights, the input
#              dynamically quantized to uint8 row by row, ORT's MatMulInteger), then the K best rows rescored in
#              full precision.
# - shortlist-int8: the shortlist's S rows ranked by their int8 copy (int8's arithmetic), the K best rescored.
#
# Each is one torch class here (calibrate runs it) and one exit graph in export/graphs.py (the runner runs it), built
# from the same tensors (`shortlist ids`, `quantize_rows_int8`).

DEFAULT_SHORTLIST = 4096  # rows of the shortlist (clamped to the vocabulary)


WEIGHT_LEVELS = 63  # |q| <= 63: 7 bits. ORT's uint8 x int8 kernel on a CPU without VNNI (AVX2's vpmaddubsw) adds
# pairs of products in int16 with saturation: 2 * 255 * 127 > 32767 gave wrong scores on an AVX2-only EPYC, while
# 2 * 255 * 63 = 32130 fits (ORT's `reduce_range`). Its uint8 x uint8 kernel is exact but was 2.3x slower there.


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[V, H] float -> (int8 [V, H], scale float32 [V]): symmetric per row, q = round(w / s), s = max|w| / 63
    (`WEIGHT_LEVELS`: 7 bits, so the product is exact on every CPU's uint8 x int8 kernel)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / float(WEIGHT_LEVELS)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp(-WEIGHT_LEVELS, WEIGHT_LEVELS).to(torch.int8)
    return q, scale


def quantize_activations_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x [N, H] quantized on its own, symmetric: (integers in [-127, 127] as float, scale [N]).

    scale = max(max |x| / 127, the smallest normal float32), q = round(x / scale), half to even as ONNX Round.
    |x / scale| <= 127 (1 + 2^-23) < 127.5, so no clamp binds. Per row, not per tensor: a row's candidates do not
    depend on the rows batched with it. Symmetric (no zero point) so the exit graph builds it from a dozen nodes
    (export_graphs._int8_scores): a node there costs more than its arithmetic. The fp32 top-1 stayed in the int8
    top-64 on every one of 8,418 GSM8K tokens at each exit of the default model, as with the asymmetric
    quantization it replaced (top-64 overlap 0.981-0.988 vs 0.986-0.990 at exits 8-24).
    """
    x = x.float()
    scale = (x.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round(x / scale[:, None]), scale


def int8_scores(normed: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    """[N, H] -> [N, V] approximate logits: (q(x) @ qweight.T) * w_scale * x_scale, the integer product exact.

    The integer dot products are summed in float32 over slices of H (each partial sum stays below 2^24, so it is
    exact whatever the summation order) and the slices added in float64: the same integers MatMulInteger computes.
    """
    a, xscale = quantize_activations_int8(normed)  # [N, H] integers in [-127, 127]
    w = qweight.float()
    h = a.shape[1]
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float64, device=a.device)
    step = max(1, (1 << 24) // (127 * 127))  # terms per exact float32 partial sum
    for lo in range(0, h, step):
        acc += (a[:, lo : lo + step] @ w[:, lo : lo + step].T).double()
    # this order, written out in the graph too: given Cast(acc) * (x_scale * w_scale), ORT fuses it into
    # MatMulIntegerToFloat, which rounds as (acc * w_scale) * x_scale; the explicit order is not fused
    return acc.float() * wscale[None, :] * xscale[:, None]


class Shortlist(CandidateSource):
    """The S most frequent tokens (ids best first); Top-K among their exact logits."""

    name = "shortlist"

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids.long()

    def torch_pick(self, head: ExitHead, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = head.lm_head_weight[self.ids]  # [S, H]
        logits = F.linear(head.normed(hidden), rows, None if head.lm_head_bias is None else head.lm_head_bias[self.ids])
        top = torch.topk(head.cap(logits), min(k, self.ids.numel()), dim=-1)
        return self.ids[top.indices], top.values

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "size": int(self.ids.numel())}


class Int8Ranking(CandidateSource):
    """The whole vocabulary ranked by the int8 LM head; the K best rescored with the exact rows."""

    name = "int8"

    def __init__(self, lm_head_weight: torch.Tensor | None) -> None:
        empty = (torch.zeros(0, 0, dtype=torch.int8), torch.zeros(0))
        self.qweight, self.scale = empty if lm_head_weight is None else quantize_rows_int8(lm_head_weight)

    def torch_pick(self, head: ExitHead, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        approx = int8_scores(head.normed(hidden), self.qweight, self.scale)
        cand = torch.topk(approx, k, dim=-1).indices
        return cand, head.local(hidden, cand)


class ShortlistInt8(Shortlist):
    """The shortlist ranked by an int8 copy of its S rows (the int8 source's arithmetic over S rows instead of V),
    the K best rescored with the exact rows. The fp32 shortlist reads S x H floats from memory for every token that
    reaches its exit (9.4 MB on the default model: bandwidth, not arithmetic); the int8 copy is a quarter of that
    (measured, S = 4,096 of the default model's head, caches cold, 2 threads: 0.39 ms fp32, 0.17 ms int8 + TopK).
    A token outside the shortlist still never exits there."""

    name = "shortlist-int8"

    def __init__(self, ids: torch.Tensor, lm_head_weight: torch.Tensor | None) -> None:
        super().__init__(ids)
        empty = (torch.zeros(0, 0, dtype=torch.int8), torch.zeros(0))
        usable = lm_head_weight is not None and self.ids.numel() > 0
        self.qweight, self.scale = quantize_rows_int8(lm_head_weight[self.ids]) if usable else empty  # type: ignore[index]

    def torch_pick(self, head: ExitHead, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        approx = int8_scores(head.normed(hidden), self.qweight, self.scale)  # [N, S]
        cand = self.ids[torch.topk(approx, min(k, self.ids.numel()), dim=-1).indices]
        return cand, head.local(hidden, cand)


def frequency_shortlist(token_ids: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent ids in `token_ids` (ties: the lower id first), topped up with the lowest unseen
    ids when fewer distinct ids occur. [size] long, most frequent first."""
    size = min(size, vocab_size)
    counts = torch.bincount(token_ids.flatten().long(), minlength=vocab_size)[:vocab_size]
    # a stable sort on -count keeps ascending ids among equal counts
    order = torch.sort(-counts, stable=True).indices
    return order[:size].clone()


CANDIDATE_SOURCES: dict[str, CandidateSource] = {}
# the default (#11): the shortlist's rows ranked in int8 and the K best rescored exactly: the same held-out coverage as
# the fp32 shortlist at 0.5-0.8x its decision time (README, calibrate)
DEFAULT_CANDIDATES = ShortlistInt8.name


def register_candidates(source: CandidateSource) -> CandidateSource:
    if source.name not in CANDIDATE_SOURCE_NAMES:  # a manifest naming it would be refused when read
        raise TypeError(f"candidate source '{source.name}' is not in eectl.contracts.names.CANDIDATE_SOURCE_NAMES")
    CANDIDATE_SOURCES[source.name] = source
    return source


register_candidates(FirstExitTopK())
register_candidates(Shortlist(torch.zeros(0, dtype=torch.long)))  # a name: make_source fills in the ids
register_candidates(Int8Ranking(None))  # a name: make_source quantizes the model's head
register_candidates(ShortlistInt8(torch.zeros(0, dtype=torch.long), None))  # a name: make_source fills it in


def make_source(name: str, head_weight: torch.Tensor, shortlist: torch.Tensor | None = None) -> CandidateSource:
    """The named source for one model: a shortlist with its ids, an int8 ranking with the model's head quantized."""
    if name == FirstExitTopK.name:
        return CANDIDATE_SOURCES[name]
    if name in (Shortlist.name, ShortlistInt8.name):
        if shortlist is None:
            raise UsageError(f"the {name} candidate source needs its token ids (a calibration made with it)")
        shortlist = shortlist.to(head_weight.device)  # the ids index the head's rows and the picks, on its device
        return Shortlist(shortlist) if name == Shortlist.name else ShortlistInt8(shortlist, head_weight)
    if name == Int8Ranking.name:
        return Int8Ranking(head_weight)
    raise UsageError(f"--candidates must be one of {', '.join(CANDIDATE_SOURCES)}, got '{name}'")
