"""Model loading and the per-architecture adapters (the only code that touches transformers internals)."""

from typing import Any

import torch

from eectl.models import loading
from eectl.models.adapters import ADAPTERS, Adapter, adapter_for, supported_model_types
from eectl.models.loading import DEFAULT_MODEL, LoadedModel, ModelSource, resolve_source
from eectl.models.parts import Dimensions, KVCache

__all__ = [
    "ADAPTERS",
    "DEFAULT_MODEL",
    "Adapter",
    "Dimensions",
    "KVCache",
    "LoadedModel",
    "ModelSource",
    "adapter_for",
    "load_model",
    "resolve_source",
    "supported_model_types",
]


def load_model(
    spec: str | None, dtype: torch.dtype = torch.float32, log: object = None, int4: Any = None
) -> LoadedModel:
    """A model and its tokenizer in eval mode with its adapter (models/loading.py); with `int4` settings
    (models/int4.py Int4Settings), its int4 twin: the model an int4 artifact of it runs."""
    loaded = loading.load_model(spec, dtype, log)
    if int4 is not None:
        from eectl.models.int4 import INT8_LEVEL, to_int4_twin

        if log is not None and hasattr(log, "log"):
            log.log("int4 twin: the weights an int4 export holds (a GGUF's own blocks, else ORT's quantizer's)")
        to_int4_twin(loaded, int4)
        keys = ("block_size", "symmetric", "algorithm", "lm_head", "keep_layers")
        loaded.weights = "int4 " + ", ".join(
            f"{k}={list(v) if k == 'keep_layers' else v}" for k in keys if (v := getattr(int4, k)) is not None
        )
        if getattr(int4, "accuracy_level", 0) == INT8_LEVEL:  # the twin's states are the int8-input kernel's
            loaded.weights += ", activations=int8"
    return loaded
