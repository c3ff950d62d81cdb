"""Model loading and the per-architecture adapters (the only code that touches transformers internals)."""

from eectl.models.adapters import ADAPTERS, Adapter, adapter_for, supported_model_types
from eectl.models.loading import DEFAULT_MODEL, LoadedModel, ModelSource, load_model, resolve_source
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
