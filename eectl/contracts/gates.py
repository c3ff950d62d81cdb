"""An exit's gate as stored in a calibration file: a linear test on the exit's input state (eectl.exits.gates
fits and applies it).
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict

GATE = "gate"  # the thresholds key of an exit's gate: its decision runs only when the gate's logit >= it


DEFAULT_GATE_KEEP = 0.99  # share of an option's passing decisions its gates keep (calibration split)


class Gate(BaseModel):
    """One exit's gate: logit = weight . h + bias on the exit's input state h [H]."""

    model_config = ConfigDict(extra="forbid")
    weight: list[float]
    bias: float

    def arrays(self) -> tuple[np.ndarray, float]:
        return np.asarray(self.weight, np.float32), float(self.bias)
