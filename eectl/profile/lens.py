"""`eectl profile`: is a checkpoint worth exiting early, and where?

Over N tokens of text, per layer l (1..L, the state after l decoder layers): top-1 agreement of the logit lens
(final norm + LM head on layer l) with the final layer, KL(final || layer l), optionally 1 - JS divergence, the
cosine between layer l's input and output (River-LLM's state transition), and the oracle exit distribution
(earliest layer from which the top-1 stays equal to the final one). Model level: the early-exit adaptability score

    EAS = mean_l  S_l^alpha * w_l^(1 - alpha),   w_l = (L - l) / L

(S_l = top-1 agreement by default, or 1 - JS divergence in bits), the oracle skip ratio and its speedup bound.

One model on one workload; several models x several workloads, compared, are profile/suite.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from eectl.errors import UsageError
from eectl.models.adapters import Adapter, Capture
from eectl.models.device import to_device

SIMILARITIES = ("top1", "js")
EAS_ALPHAS = (0.3, 0.5, 0.7)
AGREEMENT_LEVELS = (0.5, 0.9)
BOOTSTRAP = 1000
CI_LEVEL = 0.95
MIN_CHUNKS = 10  # below this many chunks a bootstrap interval says little
# Bumped when what the measurement computes changes: part of every cache key.
PROFILE_VERSION = 1


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
    device: str = "cpu"  # where it was measured (models/device.py's name)
    wall_s: float = 0.0
    peak_rss_mb: float = 0.0
    lens_dtype: str = "fp32"
    chunks: int = 0  # the bootstrap's unit
    eas_by_alpha: dict[str, float] = field(default_factory=dict)  # EAS at alpha 0.3, 0.5, 0.7
    ci: dict[str, list[float]] = field(default_factory=dict)  # 95% bootstrap intervals over chunks
    agreement_layers: dict[str, int | None] = field(default_factory=dict)  # first layer with agreement >= 0.5, 0.9
    cached: bool = False  # reused from $EECTL_CACHE (wall_s is the original run's)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def first_layer_reaching(self, agreement: float) -> int | None:
        return next((s.layer for s in self.layers if s.top1_agreement >= agreement), None)


def check_options(alpha: float, similarity: str) -> None:
    if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
        raise UsageError(f"--alpha must be in [0, 1], got {alpha}")
    if similarity not in SIMILARITIES:
        raise UsageError(f"--similarity must be one of {', '.join(SIMILARITIES)}, got '{similarity}'")


@dataclass
class ProfileSums:
    """Per-chunk sums of the per-layer measures: what the cache stores, what the bootstrap resamples.

    Every array is [C, L] (chunks x layers) except `n` [C]; means over tokens are sums / n. Chunks, not tokens,
    are the bootstrap's unit: positions within a chunk share context, so resampling tokens would understate
    the error.
    """

    n: torch.Tensor  # [C] measured tokens per chunk
    agree: torch.Tensor  # [C, L] tokens whose layer-l top-1 equals the final top-1
    kl: torch.Tensor
    js: torch.Tensor
    cosine: torch.Tensor
    oracle: torch.Tensor  # [C, L] tokens whose earliest stable-agreement layer is l

    def to_dict(self) -> dict[str, list[object]]:
        return {k: getattr(self, k).tolist() for k in ("n", "agree", "kl", "js", "cosine", "oracle")}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> ProfileSums:
        f64 = torch.float64
        return cls(
            n=torch.tensor(d["n"], dtype=torch.long),
            agree=torch.tensor(d["agree"], dtype=f64),
            kl=torch.tensor(d["kl"], dtype=f64),
            js=torch.tensor(d["js"], dtype=f64),
            cosine=torch.tensor(d["cosine"], dtype=f64),
            oracle=torch.tensor(d["oracle"], dtype=torch.long),
        )


LENS_DTYPES = ("fp32", "bf16")


@torch.no_grad()
def measure_chunks(
    adapter: Adapter,
    chunks: list[torch.Tensor],
    similarity: str = "top1",
    skip_first: int = 1,
    on_chunk: Callable[[int], None] | None = None,
    lens_dtype: str = "fp32",
) -> ProfileSums:
    """The per-chunk sums over token chunks [1, S] (the first `skip_first` positions of each are not measured).

    `lens_dtype` bf16 runs the logit lens's LM-head matmuls under CPU/CUDA autocast (the final norm and the
    softmax stay fp32); fp32 is the reference. Runs on the model's device; the sums stay there until the last chunk
    and come to the host in one copy.
    """
    if lens_dtype not in LENS_DTYPES:
        raise UsageError(f"--lens-dtype must be one of {', '.join(LENS_DTYPES)}, got '{lens_dtype}'")
    L = adapter.num_layers
    dev = adapter.device
    rows: list[torch.Tensor] = []  # per chunk, on the device: [5, L] (n, agree, kl, js, cosine sums) then oracle
    oracles: list[torch.Tensor] = []

    def lens(h: torch.Tensor) -> torch.Tensor:
        if lens_dtype == "fp32":
            return F.log_softmax(adapter.logits(h).float(), dim=-1)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            z = adapter.logits(h)
        return F.log_softmax(z.float(), dim=-1)

    for ids in chunks:
        ids = to_device(ids, dev)
        keep = Capture(range(1, L + 1), inputs=True, select=lambda h: h[0, skip_first:])
        positions = torch.arange(ids.shape[1], device=dev)[None]
        adapter.forward_layers(adapter.embed(ids), positions, 0, L, None, capture=keep)
        outs = [keep.states[layer] for layer in range(1, L + 1)]  # outs[i]: after layer index i
        cosine = torch.stack(
            [F.cosine_similarity(keep.layer_inputs[i + 1], outs[i], dim=-1).double().sum() for i in range(L)]
        )
        logp_final = lens(outs[-1])  # [T, V]
        T = logp_final.shape[0]
        top_final = logp_final.argmax(-1)
        p_final = logp_final.exp()
        zero = torch.zeros((), dtype=torch.float64, device=dev)  # the last layer's KL and JS to itself
        matches, kl, js = [], [], []
        for i in range(L - 1):
            logp = lens(outs[i])
            matches.append(logp.argmax(-1) == top_final)
            kl.append((p_final * (logp_final - logp)).sum(-1).double().sum())
            js.append(_js_bits(logp_final, logp).double().sum() if similarity == "js" else zero)
        match = torch.stack([*matches, torch.ones_like(top_final, dtype=torch.bool)])  # [L, T]
        n = torch.full((L,), float(T), dtype=torch.float64, device=dev)
        rows.append(
            torch.stack([n, match.double().sum(-1), torch.stack([*kl, zero]), torch.stack([*js, zero]), cosine])
        )
        # earliest layer from which every later layer agrees: reverse cumulative AND
        stable = match.flip(0).cumprod(0).flip(0).bool()  # [L, T]
        first = L - stable.sum(0)  # 0-based index of the first stable layer (counted below without bincount, which
        # reads its maximum on the host)
        oracles.append(torch.zeros(L, dtype=torch.long, device=dev).index_add_(0, first, torch.ones_like(first)))
        if on_chunk is not None:
            on_chunk(T)
    f64 = torch.float64
    if not rows:
        zeros = torch.zeros(0, L, dtype=f64)
        return ProfileSums(torch.zeros(0, dtype=torch.long), zeros, zeros, zeros, zeros, zeros.long())
    host, oracle = torch.stack(rows).cpu(), torch.stack(oracles).cpu()  # the run's one copy to the host: [C, 5, L]
    return ProfileSums(host[:, 0, 0].long(), host[:, 1], host[:, 2], host[:, 3], host[:, 4], oracle.long())


def profile_chunks(
    adapter: Adapter,
    chunks: list[torch.Tensor],
    alpha: float = 0.5,
    similarity: str = "top1",
    skip_first: int = 1,
    on_chunk: Callable[[int], None] | None = None,
    lens_dtype: str = "fp32",
) -> ProfileResult:
    """Profile the model on token chunks [1, S] (the first `skip_first` positions of each are not measured)."""
    check_options(alpha, similarity)
    sums = measure_chunks(adapter, chunks, similarity, skip_first, on_chunk, lens_dtype)
    return summarise(sums, adapter.num_layers, alpha, similarity)


def summarise(
    sums: ProfileSums, num_layers: int, alpha: float, similarity: str, boot: int = BOOTSTRAP, seed: int = 0
) -> ProfileResult:
    """Means over tokens, EAS and the oracle from the per-chunk sums, with bootstrap CIs over chunks."""
    n = int(sums.n.sum())
    if n == 0:
        raise UsageError("nothing to profile: no measured tokens")
    tot = {k: getattr(sums, k).sum(0) for k in ("agree", "kl", "js", "cosine", "oracle")}
    result = _summarise(
        num_layers,
        n,
        tot["agree"] / n,
        tot["kl"] / n,
        tot["js"] / n,
        tot["cosine"] / n,
        tot["oracle"],
        alpha,
        similarity,
    )
    result.chunks = len(sums.n)
    result.eas_by_alpha = {
        str(a): float(eas_of(_similarity_of(sums, similarity, None), num_layers, a)) for a in EAS_ALPHAS
    }
    result.ci = bootstrap_ci(sums, num_layers, similarity, sorted({alpha, *EAS_ALPHAS}), boot, seed)
    result.agreement_layers = {str(t): result.first_layer_reaching(t) for t in AGREEMENT_LEVELS}
    return result


def _similarity_of(sums: ProfileSums, similarity: str, idx: torch.Tensor | None) -> torch.Tensor:
    """S_l per layer: [L], or [B, L] for bootstrap index sets idx [B, C]."""
    src = sums.agree if similarity == "top1" else sums.js
    if idx is None:
        s = src.sum(0) / sums.n.sum()
        return s if similarity == "top1" else 1.0 - s
    n = sums.n[idx].sum(1, keepdim=True).double()  # [B, 1]
    s = src[idx].sum(1) / n
    return s if similarity == "top1" else 1.0 - s


def eas_of(s: torch.Tensor, num_layers: int, alpha: float) -> torch.Tensor | float:
    """EAS from S_l ([L] or [B, L]): mean over layers of S^alpha * w^(1-alpha) (0^0 = 1)."""
    L = num_layers
    w = (L - torch.arange(1, L + 1, dtype=torch.float64)) / L
    sa = torch.ones_like(s) if alpha == 0 else s.clamp(min=0.0) ** alpha
    wb = torch.ones_like(w) if alpha == 1 else w ** (1 - alpha)
    eas = (sa * wb).mean(-1)
    return float(eas) if eas.dim() == 0 else eas


def bootstrap_ci(
    sums: ProfileSums, num_layers: int, similarity: str, alphas: list[float], boot: int = BOOTSTRAP, seed: int = 0
) -> dict[str, list[float]]:
    """Percentile bootstrap (chunks resampled with replacement) 95% intervals of EAS per alpha, the oracle skip
    ratio and its speedup bound. With one chunk there is nothing to resample: the intervals collapse to the point."""
    C, L = len(sums.n), num_layers
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, C, (boot, C), generator=g)
    n = sums.n[idx].sum(1).double()  # [B]
    s = _similarity_of(sums, similarity, idx)
    lo_q, hi_q = (1 - CI_LEVEL) / 2, 1 - (1 - CI_LEVEL) / 2

    def interval(x: torch.Tensor) -> list[float]:
        q = torch.quantile(x, torch.tensor([lo_q, hi_q], dtype=x.dtype))
        return [float(q[0]), float(q[1])]

    out = {f"eas@{a}": interval(torch.as_tensor(eas_of(s, L, a))) for a in alphas}
    mean_layers = (sums.oracle[idx].sum(1).double() * torch.arange(1, L + 1, dtype=torch.float64)).sum(-1) / n
    out["oracle_skip_ratio"] = interval((L - mean_layers) / L)
    out["oracle_speedup_bound"] = interval(L / mean_layers)
    agree = sums.agree[idx].sum(1) / n[:, None]  # [B, L]
    for t in AGREEMENT_LEVELS:
        reach = agree >= t
        first = torch.where(reach.any(-1), reach.double().argmax(-1) + 1, torch.full_like(n, float(L)))
        out[f"layer@{t}"] = interval(first.double())
    return out


def _js_bits(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    m = torch.logaddexp(logp, logq) - math.log(2.0)
    p, q = logp.exp(), logq.exp()
    return 0.5 * ((p * (logp - m)).sum(-1) + (q * (logq - m)).sum(-1)) / math.log(2.0)


def _summarise(
    num_layers: int,
    n: int,
    agree: torch.Tensor,
    kl: torch.Tensor,
    js: torch.Tensor,
    cosine: torch.Tensor,
    oracle: torch.Tensor,
    alpha: float,
    similarity: str,
) -> ProfileResult:
    L = num_layers
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


def profile_key(source: Any, data: Any, tokens: int, chunk_len: int, similarity: str, lens_dtype: str) -> str:
    """What a profile's per-chunk sums depend on: the model's weights (and tokenizer files), the data, the
    settings. alpha is not in it: EAS at any alpha is recomputed from the same sums."""
    from eectl.cache import digest, model_identity, texts_sha256

    return digest(
        {
            "stage": "profile",
            "version": PROFILE_VERSION,
            "model": model_identity(source),
            "data": texts_sha256(data.texts),
            "tokens": tokens,
            "chunk_len": chunk_len,
            "js": similarity == "js",
            "lens_dtype": lens_dtype,
        }
    )


def profile_model(
    loaded: object,
    data: object,
    tokens: int,
    alpha: float = 0.5,
    similarity: str = "top1",
    chunk_len: int = 256,
    on_chunk: Callable[[int], None] | None = None,
    lens_dtype: str = "fp32",
    use_cache: bool = False,
) -> ProfileResult:
    """The stage as a library call: a LoadedModel, TextData and a token budget in; a ProfileResult out.

    `loaded` may be a callable returning the LoadedModel: with `use_cache`, a cache hit never loads the model.
    """
    import resource
    import time

    from eectl import cache
    from eectl.data import TextData, token_chunks
    from eectl.models.device import device_name
    from eectl.models.loading import LoadedModel, resolve_source

    assert isinstance(data, TextData)
    check_options(alpha, similarity)
    get = loaded if callable(loaded) else (lambda: loaded)
    source = loaded.source if isinstance(loaded, LoadedModel) else getattr(loaded, "source", None)
    key = None
    if use_cache:
        source = source or resolve_source(getattr(loaded, "spec", None))
        key = profile_key(source, data, tokens, chunk_len, similarity, lens_dtype)
        hit = cache.read("profile", key)
        if hit is not None:
            result = summarise(ProfileSums.from_dict(hit["sums"]), int(hit["num_layers"]), alpha, similarity)
            _describe(result, hit["model"], {**data.to_dict(), "tokens": tokens}, lens_dtype)
            result.threads, result.wall_s, result.peak_rss_mb = hit["threads"], hit["wall_s"], hit["peak_rss_mb"]
            result.device = hit.get("device", "cpu")
            result.cached = True
            return result
    lm = get()
    assert isinstance(lm, LoadedModel)
    skip_first = 1 if getattr(lm.tokenizer, "bos_token_id", None) is not None else 0
    chunks = token_chunks(lm.tokenizer, data, tokens, chunk_len)
    start = time.perf_counter()
    sums = measure_chunks(lm.adapter, chunks, similarity, skip_first, on_chunk, lens_dtype)
    wall = time.perf_counter() - start
    result = summarise(sums, lm.adapter.num_layers, alpha, similarity)
    _describe(
        result, {**lm.source.to_dict(), "family": lm.adapter.family}, {**data.to_dict(), "tokens": tokens}, lens_dtype
    )
    result.wall_s = wall
    result.threads = torch.get_num_threads()
    result.device = device_name(lm.adapter.device)
    result.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if key is not None:
        cache.write(
            "profile",
            key,
            {
                "sums": sums.to_dict(),
                "num_layers": lm.adapter.num_layers,
                "model": result.model,
                "threads": result.threads,
                "device": result.device,
                "wall_s": result.wall_s,
                "peak_rss_mb": result.peak_rss_mb,
            },
        )
    return result


def _describe(result: ProfileResult, model: dict[str, object], data: dict[str, object], lens_dtype: str) -> None:
    result.model, result.data, result.lens_dtype = model, data, lens_dtype
