"""The calibration's option menu (calibrate/fit.py `options`): one configuration of active exits and thresholds,
judged out of fold on the model's own continuations, with its counts per unit (what the plan's intervals resample)
and per position in the answer (what a run of another length is priced on: `Option.at_length`).

What this module does not do: price an option (plan/choose.py) or fit one (calibrate/fit.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, field_validator

# positions in an answer per block of `Option.blocks`: a run's length is priced on whole blocks
POSITION_BLOCK = 8


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ExitOption(_M):
    layer: int
    thresholds: dict[str, float]  # criterion -> exit when value >= it
    coverage: float  # held-out share of ALL tokens that exit here
    precision: float | None  # held-out agreement with the final top-1 among them (None: none exited)
    # gated options (thresholds hold a "gate": eectl.exits.gates): held-out share of ALL tokens whose decision runs
    # here,
    # and of those, the share that picks the candidates here (no earlier gate passed). None: ungated, every token
    # reaching the exit decides there, the first exit picking
    decided: float | None = None
    picked: float | None = None


class Option(_M):
    """One calibrated configuration: these exits active, with thresholds fitted at `target`."""

    exits: list[int]
    kind: str  # "target": fitted at the calibration's fidelity target (copy, defer); "verify": a speed knob
    target: float
    confidence: float | None
    per_exit: list[ExitOption]
    agreement: float  # held-out agreement over all tokens (exit or not)
    # the judged tokens' counts per unit (a teacher-forced chunk or a prompt's continuation): [tokens, then per exit:
    # exited, exited and right, decided, picked] (the last two 0 ungated), as text (`units_text`: one line in a file,
    # parsed only where the plan resamples it, `unit_rows`). What the plan's interval over the calibration sample
    # resamples (`resampled`); "" in calibration files written before it
    units: str = ""
    # the same counts per block of POSITION_BLOCK positions in the answer, block 0 first, over every judged
    # continuation (`at_length`; "" in calibration files written before them)
    blocks: str = ""

    @field_validator("units", "blocks", mode="before")
    @classmethod
    def _units_from_rows(cls, value: object) -> object:
        """Counts given as rows (and calibration files that stored them so, briefly): their text."""
        return cls.units_text(value) if isinstance(value, list) else value

    @staticmethod
    def units_text(rows: Sequence[Sequence[int]]) -> str:
        """Counts per unit as `units` holds them: a unit's counts space-separated, units separated by ';'."""
        return ";".join(" ".join(map(str, row)) for row in rows)

    @staticmethod
    def _rows(text: str) -> list[list[int]]:
        return [[int(x) for x in row.split()] for row in text.split(";")] if text else []

    def unit_rows(self) -> list[list[int]]:
        return self._rows(self.units)

    def resampled(self, picks: Sequence[int], rows: Sequence[Sequence[int]] | None = None) -> Option:
        """The option as judged on the units at these indices of `unit_rows()` (`rows`, when already parsed; repeats
        count again: a bootstrap resample): each exit's coverage, precision and gated shares from their summed
        counts."""
        every = self.unit_rows() if rows is None else rows
        return self._from_counts([every[i] for i in picks])

    def block_rows(self) -> list[list[int]]:
        return self._rows(self.blocks)

    def at_length(self, tokens: int) -> Option:
        """The option as judged on the first `tokens` positions of each answer (a run's --max-new-tokens): exits are
        taken at other rates early in an answer than later (the default model's verify [8] on 24 GSM8K answers: 51%
        of positions 0-15, ~26% of 16-63). Beyond the positions judged, the second half of them stands for the rest
        (an answer's later positions exit alike). Itself without blocks."""
        rows = self.block_rows()
        if not rows:
            return self
        keep: list[Sequence[float]] = [r for b, r in enumerate(rows) if b * POSITION_BLOCK < tokens]
        judged = len(rows) * POSITION_BLOCK
        if tokens > judged:  # per position beyond: the second half's counts per position
            tail = rows[len(rows) // 2 :]
            scale = (tokens - judged) / (len(tail) * POSITION_BLOCK)
            keep = [*rows, [sum(r[j] for r in tail) * scale for j in range(len(rows[0]))]]
        return self._from_counts(keep).model_copy(update={"blocks": ""})

    def _from_counts(self, chosen: Sequence[Sequence[float]]) -> Option:
        n = sum(r[0] for r in chosen)
        per_exit = []
        for i, x in enumerate(self.per_exit):
            exited, right, decided, picked = (sum(r[1 + 4 * i + j] for r in chosen) for j in range(4))
            per_exit.append(
                x.model_copy(
                    update={
                        "coverage": exited / n if n else 0.0,
                        "precision": right / exited if exited else None,
                        "decided": None if x.decided is None else (decided / n if n else 0.0),
                        "picked": None if x.picked is None else (picked / n if n else 0.0),
                    }
                )
            )
        return self.model_copy(update={"per_exit": per_exit, "units": ""})

    @property
    def exit_rate(self) -> float:
        return sum(x.coverage for x in self.per_exit)

    def thresholds(self) -> dict[int, dict[str, float]]:
        return {x.layer: dict(x.thresholds) for x in self.per_exit}

    @property
    def gated(self) -> bool:
        return any(x.decided is not None for x in self.per_exit)
