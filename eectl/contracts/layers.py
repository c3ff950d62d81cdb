"""Exit-layer lists: how `--exits` is parsed, the rules every stage applies to a list of exit layers, the default
exits of a model.
"""

from __future__ import annotations

from eectl.errors import UsageError


def parse_layers(text: str | None, option: str = "--exits") -> list[int] | None:
    """The one parser of exit lists: "8,12" -> [8, 12]; "none" -> [] (full depth); None (not given) -> None."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return []
    try:
        layers = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UsageError(f"{option} must be comma-separated layer numbers or 'none', got '{text}'") from None
    if not layers:  # "" or ",": full depth for run and export, the default exits for calibrate; say which was meant
        raise UsageError(f"{option} names no layers, got '{text}'", hint="give e.g. 8,12, or 'none' for no layers")
    return layers


def needed_layers(text: str | None, command: str, option: str = "--exits") -> list[int] | None:
    """parse_layers for a command that fits something at its exits (calibrate, train-heads): 'none' names no exit to
    fit and is refused, not read as "not given" (the default exits)."""
    layers = parse_layers(text, option)
    if layers == []:
        raise UsageError(
            f"{command} needs at least one exit, got {option} '{text}'",
            hint=f"give e.g. {option} 8,12, or leave {option} out for the default exits",
        )
    return layers


def check_exit_layers(exits: list[int], num_layers: int | None, option: str = "--exits") -> list[int]:
    """The one check of exit lists: distinct layers, each in 1..L-1 once the model's depth L is known; sorted."""
    if len(set(exits)) != len(exits):
        raise UsageError(f"{option} must be distinct, got {exits}")
    top = None if num_layers is None else num_layers - 1
    bad = [e for e in exits if e < 1 or (top is not None and e > top)]
    if bad:
        where = "(an exit sits after layer 1 or later)" if top is None else f"1..{top}"
        raise UsageError(
            f"{option} {bad} outside the model's layers {where}",
            hint=None if top is None else f"an exit after layer l reads the state after l of the {num_layers} layers",
        )
    return sorted(exits)


def default_exits(num_layers: int) -> list[int]:
    """Five exits spread over the middle of the stack: 8, 12, 16, 20, 24 for 30 layers."""
    picks = {round(num_layers * f / 15) for f in (4, 6, 8, 10, 12)}
    return sorted(e for e in picks if 1 <= e < num_layers)
