"""What `eectl eval` counts per configuration, shared by the lm-eval model classes and the eval table (no lm_eval
import here: importing eectl never needs it)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default
# texts scored per pass (loglikelihood requests, padded to the longest; runtime/scoring.py). On the CPU EP one text a
# pass is fastest (the default model at 2 threads, 20 GSM8K texts: 1 a pass 377 positions/s, 2: 322, 4: 310, 8: 307;
# a text's matrices are already S rows tall, and padding costs): batches serve device providers
DEFAULT_BATCH = 1


@dataclass
class EvalStats:
    """Exit layers of the tokens the runner decided (generation: emitted tokens; scoring: continuation tokens), and
    the request work with the time it took: the same counts for lm-eval's hf model (lmeval_model.TimedHFLM)."""

    tokens: int = 0
    layer_sum: int = 0
    num_layers: int = 0
    scored_tokens: int = 0  # loglikelihood: positions the model ran (context + continuation - 1 per request)
    scoring_s: float = 0.0
    generated_tokens: int = 0  # generate_until: tokens of the returned texts (re-encoded, the same count for all)
    generation_s: float = 0.0

    def add(self, layers: list[int], num_layers: int) -> None:
        self.tokens += len(layers)
        self.layer_sum += int(sum(layers))
        self.num_layers = num_layers

    def add_scoring(self, tokens: int, seconds: float) -> None:
        self.scored_tokens += tokens
        self.scoring_s += seconds

    def add_generation(self, tokens: int, seconds: float) -> None:
        self.generated_tokens += tokens
        self.generation_s += seconds

    @property
    def mean_layers(self) -> float | None:
        return self.layer_sum / self.tokens if self.tokens else None

    @property
    def scoring_tps(self) -> float | None:
        return self.scored_tokens / self.scoring_s if self.scoring_s > 0 else None

    @property
    def generation_tps(self) -> float | None:
        return self.generated_tokens / self.generation_s if self.generation_s > 0 else None
