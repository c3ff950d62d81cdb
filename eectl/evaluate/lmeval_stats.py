"""What `eectl eval` counts per configuration, shared by the lm-eval model class and the eval table (no lm_eval
import here: importing eectl never needs it)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default


@dataclass
class EvalStats:
    """Exit layers of the tokens the runner decided (generation: emitted tokens; scoring: continuation tokens)."""

    tokens: int = 0
    layer_sum: int = 0
    num_layers: int = 0

    def add(self, layers: list[int], num_layers: int) -> None:
        self.tokens += len(layers)
        self.layer_sum += int(sum(layers))
        self.num_layers = num_layers

    @property
    def mean_layers(self) -> float | None:
        return self.layer_sum / self.tokens if self.tokens else None
