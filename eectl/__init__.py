"""eectl: early-exit LLM inference made real (profile, calibrate, train heads, export, run, bench)."""

__version__ = "0.1.0"
