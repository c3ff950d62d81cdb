"""`--thresholds` (run, bench, eval): its form checked before an artifact loads (`threshold_syntax`), and its values
per active exit and criterion once the artifact says which exits run and what the signal's criteria are
(`parse_thresholds`).

The forms: `0.9` (every active exit, every criterion), `12:0.9,20:0.8` (per exit, each exit named once), a
criterion pair as `0.9/0.2` or `12:0.9/0.2`. A value that would be dropped (an exit that does not run, no exit active
at all) is refused, not ignored; so are bench's and eval's --exits and --thresholds where no configuration they list
runs an exit (`check_exit_options_used`).
"""

from __future__ import annotations

import math

from eectl.contracts.layers import parse_layers
from eectl.contracts.names import threshold_problem
from eectl.errors import UsageError

Entries = list[tuple[int | None, list[float]]]  # (the exit, None for every active exit; its values) per part


def _entries(text: str) -> Entries:
    """The parts of `text`, each (exit or None, values): one part without an exit, or every part naming its exit,
    each exit once, every value finite (UsageError, one line, otherwise)."""
    cannot = f"--thresholds: cannot parse '{text}' (e.g. 0.9, or 12:0.9,20:0.8)"
    try:
        entries: Entries = []
        for part in text.split(","):
            layer, _, values = part.rpartition(":")
            entries.append((int(layer) if layer else None, [float(v) for v in values.split("/")]))
    except ValueError:
        raise UsageError(cannot) from None
    named = [layer for layer, _ in entries if layer is not None]
    if len(entries) > 1 and len(named) != len(entries):  # '0.9,0.8' or '0.9,12:0.8': a value for which exit?
        raise UsageError(cannot)
    if not all(math.isfinite(v) for _, values in entries for v in values):
        raise UsageError(f"--thresholds must be finite numbers, got '{text}'")  # NaN never passes: nothing would exit
    if repeated := sorted({e for e in named if named.count(e) > 1}):  # the last value won, silently
        raise UsageError(f"--thresholds names exits {repeated} more than once, got '{text}'")
    return entries


def threshold_syntax(text: str) -> None:
    """--thresholds' form alone (before an artifact says which exits and criteria): numbers, `layer:`, `/`, `,`,
    each exit named once."""
    _entries(text)


def no_exit_active(text: str) -> None:
    """Refuse --thresholds where no exit is active (full depth): every value would be dropped, silently."""
    entries = _entries(text)
    if entries[0][0] is None:
        raise UsageError(
            f"--thresholds '{text}' sets the active exits' thresholds, but no exit is active (full depth)",
            hint="drop --thresholds, or name exits with --exits",
        )
    named = sorted(e for e, _ in entries if e is not None)
    raise UsageError(
        f"--thresholds names exits {named}, but no exit is active (full depth)", hint="add them to --exits"
    )


def parse_thresholds(text: str, exits: list[int], criteria: tuple[str, ...]) -> dict[int, dict[str, float]]:
    """'0.9' (every exit, every criterion) or '12:0.9,20:0.8' (per exit); a criterion pair as '12:0.9/0.2'. Every
    value must land on an active exit, and every active exit must get one."""
    entries = _entries(text)
    if not exits:
        no_exit_active(text)
    try:
        if entries[0][0] is None:
            values = dict(zip(criteria, _fill(entries[0][1], criteria), strict=True))
            out = {e: dict(values) for e in exits}
        else:
            out = {e: dict(zip(criteria, _fill(v, criteria), strict=True)) for e, v in entries if e is not None}
    except ValueError:
        raise UsageError(f"--thresholds: cannot parse '{text}' (e.g. 0.9, or 12:0.9,20:0.8)") from None
    if outside := sorted(set(out) - set(exits)):  # their values were dropped, silently
        raise UsageError(
            f"--thresholds names exits {outside}, not among the active exits {exits}", hint="add them to --exits"
        )
    missing = [e for e in exits if e not in out]
    if missing:
        raise UsageError(f"--thresholds gives no value for exits {missing}")
    for e in exits:  # a probability of 2.0 never passes, -0.5 always does: an exit that can never or always fire
        for criterion, value in out[e].items():
            if problem := threshold_problem(criterion, value):
                raise UsageError(f"--thresholds '{text}': exit {e}'s {problem}")
    return {e: out[e] for e in exits}


def _fill(values: list[float], criteria: tuple[str, ...]) -> list[float]:
    if len(values) == 1:
        return values * len(criteria)
    if len(values) != len(criteria):
        raise ValueError("wrong number of threshold values")
    return values


def check_exit_options_used(
    exits: str | None, thresholds: str | None, option: str, configs: list[str], early: tuple[str, ...]
) -> None:
    """bench's and eval's --exits and --thresholds set their early-exit configurations (`early`): refused where the
    configurations listed (`option`: --policies, --configs) run none, which would drop them, silently."""
    if any(c in early for c in configs):
        return
    for flag, given in (("--exits", bool(parse_layers(exits))), ("--thresholds", thresholds is not None)):
        if given:
            raise UsageError(
                f"{flag} sets the early-exit configurations, but none of {', '.join(configs)} runs an exit",
                hint=f"add one to {option}: {', '.join(early)}; or drop {flag}",
            )
