"""`eectl profile`: is a checkpoint worth exiting early, and where?

Over N tokens of text, per layer l (1..L, the state after l decoder layers): top-1 agreement of the logit lens
(final norm + LM head on layer l) with the final layer, KL(final || layer l), optionally 1 - JS divergence, the
cosine between layer l's input and output (River-LLM's state transition), and the oracle exit distribution
(earliest layer from which the top-1 stays equal to the final one). Model level: the early-exit adaptability score

    EAS = mean_l  S_l^alpha * w_l^(1 - alpha),   w_l = (L - l) / L

(S_l = top-1 agreement by default, or 1 - JS divergence in bits), the oracle skip ratio and its speedup bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from eectl.errors import UsageError
from eectl.models.adapters import Adapter, Capture

SIMILARITIES = ("top1", "js")


@dataclass
class LayerStats:
    layer: int  # 1..L: the hidden state after this many decoder layers
    top1_agreement: float
    kl: float  # KL(final || layer), nats, mean over tokens
    js_similarity: float | None  # 1 - JS(final, layer) in bits, when computed
    transition_cosine: float  # cos(input of layer, output of layer), mean over tokens
    oracle_exits: int  # tokens whose earliest stable-agreement layer is this one
    similarity: float  # S_l used in EAS
    skip_fraction: float  # w_l = (L - l) / L
    eas_term: float  # A_l = S_l^alpha * w_l^(1 - alpha)


@dataclass
class ProfileResult:
    model: dict[str, object]
    data: dict[str, object]
    tokens: int
    num_layers: int
    alpha: float
    similarity: str
    eas: float
    oracle_skip_ratio: float  # share of layer computations skippable with zero disagreement
    oracle_mean_layers: float
    oracle_speedup_bound: float  # L / mean executed layers
    layers: list[LayerStats] = field(default_factory=list)
    verdict: str = ""
    threads: int = 0
    wall_s: float = 0.0
    peak_rss_mb: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def first_layer_reaching(self, agreement: float) -> int | None:
        return next((s.layer for s in self.layers if s.top1_agreement >= agreement), None)


def check_options(alpha: float, similarity: str) -> None:
    if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
        raise UsageError(f"--alpha must be in [0, 1], got {alpha}")
    if similarity not in SIMILARITIES:
        raise UsageError(f"--similarity must be one of {', '.join(SIMILARITIES)}, got '{similarity}'")


@torch.no_grad()
def profile_chunks(
    adapter: Adapter,
    chunks: list[torch.Tensor],
    alpha: float = 0.5,
    similarity: str = "top1",
    skip_first: int = 1,
    on_chunk: Callable[[int], None] | None = None,
) -> ProfileResult:
    """Profile the model on token chunks [1, S] (the first `skip_first` positions of each are not measured)."""
    check_options(alpha, similarity)
    L = adapter.num_layers
    agree = torch.zeros(L, dtype=torch.float64)
    kl = torch.zeros(L, dtype=torch.float64)
    js = torch.zeros(L, dtype=torch.float64)
    cosine = torch.zeros(L, dtype=torch.float64)
    oracle = torch.zeros(L, dtype=torch.long)
    n = 0
    for ids in chunks:
        keep = Capture(range(1, L + 1), inputs=True, select=lambda h: h[0, skip_first:])
        positions = torch.arange(ids.shape[1])[None]
        adapter.forward_layers(adapter.embed(ids), positions, 0, L, None, capture=keep)
        outs = [keep.states[layer] for layer in range(1, L + 1)]  # outs[i]: after layer index i
        for i in range(L):
            cosine[i] += F.cosine_similarity(keep.layer_inputs[i + 1], outs[i], dim=-1).double().sum()
        logp_final = F.log_softmax(adapter.logits(outs[-1]).float(), dim=-1)  # [T, V]
        top_final = logp_final.argmax(-1)
        p_final = logp_final.exp()
        matches = torch.ones(L, logp_final.shape[0], dtype=torch.bool)
        for i in range(L - 1):
            logp = F.log_softmax(adapter.logits(outs[i]).float(), dim=-1)
            matches[i] = logp.argmax(-1) == top_final
            kl[i] += (p_final * (logp_final - logp)).sum(-1).double().sum()
            if similarity == "js":
                js[i] += _js_bits(logp_final, logp).double().sum()
        agree += matches.double().sum(-1)
        # earliest layer from which every later layer agrees: reverse cumulative AND
        stable = matches.flip(0).cumprod(0).flip(0).bool()  # [L, T]
        first = L - stable.sum(0)  # 0-based index of the first stable layer
        oracle += torch.bincount(first, minlength=L)[:L]
        n += logp_final.shape[0]
        if on_chunk is not None:
            on_chunk(logp_final.shape[0])
    if n == 0:
        raise UsageError("nothing to profile: no measured tokens")
    return _summarise(adapter, n, agree / n, kl / n, js / n, cosine / n, oracle, alpha, similarity)


def _js_bits(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    m = torch.logaddexp(logp, logq) - math.log(2.0)
    p, q = logp.exp(), logq.exp()
    return 0.5 * ((p * (logp - m)).sum(-1) + (q * (logq - m)).sum(-1)) / math.log(2.0)


def _summarise(
    adapter: Adapter,
    n: int,
    agree: torch.Tensor,
    kl: torch.Tensor,
    js: torch.Tensor,
    cosine: torch.Tensor,
    oracle: torch.Tensor,
    alpha: float,
    similarity: str,
) -> ProfileResult:
    L = adapter.num_layers
    layers: list[LayerStats] = []
    for i in range(L):
        layer = i + 1
        js_sim = None if similarity != "js" else float(1.0 - js[i])
        s = float(agree[i]) if similarity == "top1" else float(js_sim if js_sim is not None else 0.0)
        w = (L - layer) / L
        layers.append(
            LayerStats(
                layer=layer,
                top1_agreement=float(agree[i]),
                kl=float(kl[i]),
                js_similarity=js_sim,
                transition_cosine=float(cosine[i]),
                oracle_exits=int(oracle[i]),
                similarity=s,
                skip_fraction=w,
                eas_term=_eas_term(s, w, alpha),
            )
        )
    eas = sum(s.eas_term for s in layers) / L
    mean_layers = float((oracle.double() * torch.arange(1, L + 1, dtype=torch.float64)).sum() / n)
    return ProfileResult(
        model={},
        data={},
        tokens=n,
        num_layers=L,
        alpha=alpha,
        similarity=similarity,
        eas=eas,
        oracle_skip_ratio=(L - mean_layers) / L,
        oracle_mean_layers=mean_layers,
        oracle_speedup_bound=L / mean_layers,
        layers=layers,
        verdict=verdict(eas, (L - mean_layers) / L),
    )


def _eas_term(s: float, w: float, alpha: float) -> float:
    # 0^0 = 1 by convention, so alpha = 0 (pure depth) and alpha = 1 (pure similarity) are well defined.
    sa = 1.0 if alpha == 0 else max(s, 0.0) ** alpha
    wb = 1.0 if alpha == 1 else w ** (1 - alpha)
    return sa * wb


def verdict(eas: float, oracle_skip: float) -> str:
    bound = 1 / max(1e-9, 1 - oracle_skip)
    if eas >= 0.45 and oracle_skip >= 0.25:
        return f"good candidate: EAS {eas:.2f}, an oracle could skip {oracle_skip:.0%} of layers ({bound:.2f}x bound)"
    if eas >= 0.3 and oracle_skip >= 0.1:
        return (
            f"moderate: EAS {eas:.2f}, oracle skip {oracle_skip:.0%} ({bound:.2f}x bound); "
            "calibrated exits will keep only part of it"
        )
    return (
        f"poor candidate as is: EAS {eas:.2f}, oracle skip {oracle_skip:.0%} ({bound:.2f}x bound); "
        "trained exit heads are needed for early layers to agree"
    )


def plot(result: ProfileResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s.layer for s in result.layers]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.plot(x, [s.top1_agreement for s in result.layers], marker="o", label="top-1 agreement")
    ax.plot(x, [s.transition_cosine for s in result.layers], marker=".", label="transition cosine")
    ax.plot(x, [s.eas_term for s in result.layers], linestyle="--", label=f"EAS term (alpha={result.alpha})")
    if result.similarity == "js":
        ax.plot(x, [s.js_similarity for s in result.layers], label="1 - JS")
    ax.set_xlabel("layer")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    ax.set_title(f"EAS {result.eas:.3f} ({result.similarity})")
    axes[1].semilogy(x[:-1], [max(s.kl, 1e-6) for s in result.layers[:-1]], marker="o")
    axes[1].set_xlabel("layer")
    axes[1].set_title("KL(final || layer), nats")
    axes[2].bar(x, [s.oracle_exits / result.tokens for s in result.layers])
    axes[2].set_xlabel("oracle exit layer")
    axes[2].set_title(f"oracle exits: skip {result.oracle_skip_ratio:.1%}, bound {result.oracle_speedup_bound:.2f}x")
    fig.suptitle(str(result.model.get("name", "")))
    fig.tight_layout()
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def profile_model(
    loaded: object,
    data: object,
    tokens: int,
    alpha: float = 0.5,
    similarity: str = "top1",
    chunk_len: int = 256,
    on_chunk: Callable[[int], None] | None = None,
) -> ProfileResult:
    """The stage as a library call: a LoadedModel, TextData and a token budget in; a ProfileResult out."""
    import resource
    import time

    from eectl.data import TextData, token_chunks
    from eectl.models.loading import LoadedModel

    assert isinstance(loaded, LoadedModel) and isinstance(data, TextData)
    check_options(alpha, similarity)
    skip_first = 1 if getattr(loaded.tokenizer, "bos_token_id", None) is not None else 0
    chunks = token_chunks(loaded.tokenizer, data, tokens, chunk_len)
    start = time.perf_counter()
    result = profile_chunks(loaded.adapter, chunks, alpha, similarity, skip_first, on_chunk)
    result.wall_s = time.perf_counter() - start
    result.model = {**loaded.source.to_dict(), "family": loaded.adapter.family}
    result.data = {**data.to_dict(), "tokens": tokens}
    result.threads = torch.get_num_threads()
    result.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result
