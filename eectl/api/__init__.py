"""eectl's Python API: `load(artifact, **run_options)` -> `Model` (`generate`, `chat`, streaming), a `Completion`
per answer; docs/api.md. Requests from several threads share one continuously batched engine (engine.py)."""

from eectl.api.model import Completion, Model, Streaming, load
from eectl.run.engine import QueueFull, Stopped

__all__ = ["Completion", "Model", "QueueFull", "Stopped", "Streaming", "load"]
