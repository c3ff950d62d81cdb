"""The suitability benchmark: several models x several workloads, each pair profiled (profile/lens.py
`profile_model`, cached), one comparison (`Suite`) that profile/report.py writes as a table, a plot and JSON.

Each model is loaded at most once, and only when one of its (model, workload) results is not in the cache
(`LazyModel`). What this module does not do: measure anything itself (lens.py does) or write the report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from eectl.profile.lens import (
    AGREEMENT_LEVELS,
    BOOTSTRAP,
    CI_LEVEL,
    EAS_ALPHAS,
    ProfileResult,
    check_options,
    profile_model,
)


class LazyModel:
    """A model known by its source (hashable without loading), loaded on the first call (onto `device`) and kept."""

    def __init__(
        self, spec: str | None, log: Callable[[str], None] | None = None, device: torch.device | str = "cpu"
    ) -> None:
        from eectl.models.loading import resolve_source

        self.spec, self.log, self.device = spec, log, device
        self.source = resolve_source(spec)
        self._loaded: Any = None

    def __call__(self) -> Any:
        if self._loaded is None:
            from eectl.models import load_model

            if self.log is not None:
                self.log(f"loading {self.spec or 'the default model (SmolLM2-135M-Instruct)'}")
            self._loaded = load_model(self.spec)
            self._loaded.model.to(self.device)
        return self._loaded


def profile_suite(
    models: list[str | None],
    workloads: list[tuple[str, Any]],
    tokens: int,
    alpha: float = 0.5,
    similarity: str = "top1",
    chunk_len: int = 256,
    lens_dtype: str = "fp32",
    use_cache: bool = True,
    on_chunk: Callable[[int], None] | None = None,
    log: Callable[[str], None] | None = None,
    device: str = "cpu",
) -> Suite:
    """Profile every model on every workload (TextData) on the torch `device` (models/device.py's names), each model
    loaded at most once and only when one of its (model, workload) results is not in the cache."""
    from eectl.models.device import device_name, resolve_device

    check_options(alpha, similarity)
    where = resolve_device(device)
    entries: list[SuiteEntry] = []
    for spec in models:
        lazy = LazyModel(spec, log, where)
        source = lazy.source
        for name, data in workloads:
            result = profile_model(
                lazy, data, tokens, alpha, similarity, chunk_len, on_chunk, lens_dtype, use_cache=use_cache
            )
            if result.cached and on_chunk is not None:
                on_chunk(tokens)
            if log is not None:
                how = "from the cache" if result.cached else f"in {result.wall_s:.0f} s"
                log(f"{source.name} x {name}: EAS {result.eas:.3f}, oracle skip {result.oracle_skip_ratio:.1%} ({how})")
            entries.append(SuiteEntry(source.name, name, result))
    settings = {
        "tokens": tokens,
        "chunk_len": chunk_len,
        "similarity": similarity,
        "alphas": list(EAS_ALPHAS),
        "lens_dtype": lens_dtype,
        "bootstrap": {"resamples": BOOTSTRAP, "unit": f"chunks of {chunk_len} tokens", "level": CI_LEVEL},
        "threads": torch.get_num_threads(),
        "device": device_name(where),
    }
    return Suite(entries, settings)


@dataclass
class SuiteEntry:
    model: str
    workload: str
    result: ProfileResult

    def summary(self) -> dict[str, object]:
        r = self.result
        return {
            "model": self.model,
            "workload": self.workload,
            "tokens": r.tokens,
            "chunks": r.chunks,
            "num_layers": r.num_layers,
            "eas": r.eas_by_alpha,
            "eas_ci": {str(a): r.ci[f"eas@{a}"] for a in EAS_ALPHAS},
            "oracle_skip_ratio": r.oracle_skip_ratio,
            "oracle_skip_ratio_ci": r.ci["oracle_skip_ratio"],
            "oracle_speedup_bound": r.oracle_speedup_bound,
            "oracle_speedup_bound_ci": r.ci["oracle_speedup_bound"],
            "agreement_layers": r.agreement_layers,
            "agreement_layers_ci": {str(t): r.ci[f"layer@{t}"] for t in AGREEMENT_LEVELS},
            "cached": r.cached,
            "wall_s": r.wall_s,
        }


@dataclass
class Suite:
    entries: list[SuiteEntry]
    settings: dict[str, object]

    def to_dict(self) -> dict[str, object]:
        return {
            "settings": self.settings,
            "comparison": [e.summary() for e in self.entries],
            "results": [{"model": e.model, "workload": e.workload, **e.result.to_dict()} for e in self.entries],
        }
