"""What a bench's generations say of fidelity beyond agreement with full depth: every row against the fp32 model's
tokens, the sequence certificate's risk on the bench's prompts, GSM8K accuracy (evaluate/bench.py calls them).

What this module does not do: time or run anything (evaluate/bench.py, evaluate/configs.py).
"""

from __future__ import annotations

from typing import Any

from eectl.calibrate.sequence import realized_risk
from eectl.contracts.certificate import CERTIFIED
from eectl.contracts.manifest import Manifest
from eectl.data import final_number
from eectl.evaluate.configs import Configs
from eectl.evaluate.results import ConfigResult
from eectl.evaluate.stats import prefix_agreement
from eectl.evaluate.timing import _Run


def fp32_fidelity(configs: Configs, results: list[ConfigResult], runs: dict[str, list[_Run]]) -> str | None:
    """Every timed row's tokens against the fp32 model's (first repetition): those of full depth of an fp32 artifact,
    this one's, else the first compared one's, else transformers' greedy generate on the source checkpoint (`hf`,
    float32 weights: for a GGUF its dequantized tensors); its name, or None (none of them ran: the fields stay
    empty)."""
    fp32 = [
        name for name in ["full", *configs.opts.compare] if name in runs and is_fp32(configs.runners[name].rt.manifest)
    ]
    if not fp32 and "hf" in runs:
        fp32 = ["hf"]
    if not fp32:
        return None
    want = runs[fp32[0]][0].generations
    for r in results:
        r.fp32_first_divergence, r.fp32_prefix_share = prefix_agreement(runs[r.name][0].generations, want)
    return fp32[0]


def is_fp32(m: Manifest) -> bool:
    """Whether an artifact's segments compute in fp32 (no int4 segments, no fp16)."""
    return m.dtype == "fp32" and (m.quantization is None or m.quantization.scope != "segments")


def certificate_check(cert: Any, runs: dict[str, Any], tok: Any, answers: Any, generated: int) -> str:
    """The certificate's risk on this run's prompts (its certified configuration against full depth), as a line."""
    if cert is None or CERTIFIED not in runs:
        return ""
    got, full = runs[CERTIFIED][0].generations, runs["full"][0].generations
    decode = lambda t: str(tok.decode(t, skip_special_tokens=True))  # noqa: E731
    return realized_risk(cert, got, full, decode, answers or [None] * len(got), generated)[1]


def accuracy(tok: Any, gens: list[list[int]], answers: list[str | None]) -> float | None:
    scored = [(g, a) for g, a in zip(gens, answers, strict=False) if a is not None]
    if not scored:
        return None
    hits = sum(final_number(tok.decode(g, skip_special_tokens=True)) == a for g, a in scored)
    return hits / len(scored)
