"""eectl: early-exit LLM inference made real (profile, calibrate, train heads, export, run, bench).

`eectl.load(artifact, **run_options)` opens an artifact for generation (eectl/api, docs/api.md); it is imported on
first use, so `import eectl` stays light (no torch, no ONNX Runtime).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# the API's names, resolved from eectl.api on first access (PEP 562); by name, so the root package, below every
# stage, imports none of them
_API = ("load", "Model", "Completion", "Streaming", "QueueFull")


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module("eectl.api"), name)
    raise AttributeError(f"module 'eectl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
