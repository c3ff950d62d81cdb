"""One Output object for every command: rich tables for people, one JSON document on stdout with --json.

Progress bars, logs and hints go to stderr; in JSON mode progress is off so stdout stays machine-readable.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

EMPTY_CELLS = ("", "-", "None")  # what a table cell shows for "no value"


def utf8_streams() -> None:
    """stdout and stderr write UTF-8 where the locale says ASCII (a C locale without Python's UTF-8 mode): eectl
    reads its text inputs and arguments as UTF-8 whatever the locale, and a generated "é" raised
    UnicodeEncodeError mid-answer. Other encodings (a UTF-8 or Latin-1 locale) are the terminal's and are kept."""
    import codecs

    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None)
        if encoding and codecs.lookup(encoding).name == "ascii" and hasattr(stream, "reconfigure"):
            stream.reconfigure(encoding="utf-8")


class Output:
    def __init__(self, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        utf8_streams()
        self.out = Console(file=sys.stdout, soft_wrap=True)
        self.err = Console(file=sys.stderr, soft_wrap=True)

    def log(self, message: str) -> None:
        """A progress or status line for people: stderr, silent in JSON mode."""
        if not self.json_mode and not self.quiet:
            self.err.print(message)

    def warn(self, message: str) -> None:
        self.err.print(f"[yellow]warning:[/yellow] {message}")

    def table(self, title: str, columns: list[str], rows: Iterable[Iterable[Any]]) -> None:
        """A table that fits the terminal without cutting a word: columns with no value in any row are dropped
        (the JSON keeps them), no column is narrower than its header's longest word, and cells fold instead of
        ending in an ellipsis."""
        if self.json_mode:
            return
        cells = [[str(c) for c in row] for row in rows]
        keep = [i for i in range(len(columns)) if i == 0 or any(r[i] not in EMPTY_CELLS for r in cells)]
        # no rules and one space between columns: the room goes to the values
        table = Table(title=title, box=None, padding=(0, 1), collapse_padding=True, header_style="bold underline")
        for i in keep:
            col = columns[i]
            widest = max((len(w) for w in col.split()), default=1)
            table.add_column(col, justify="left" if i == 0 else "right", min_width=widest, overflow="fold")
        for r in cells:
            table.add_row(*[r[i] for i in keep])
        # laid out to the terminal's width; a table whose headers' words cannot fit is printed wider, never cut
        self.out.print(table, soft_wrap=False, crop=False)

    def line(self, message: str) -> None:
        """A result line for people (stdout); nothing in JSON mode."""
        if not self.json_mode:
            self.out.print(message)

    def json(self, document: Any) -> None:
        """The one JSON document of a command: printed only in JSON mode."""
        if self.json_mode:
            sys.stdout.write(json.dumps(document, indent=2, default=_jsonable) + "\n")
            sys.stdout.flush()

    @contextmanager
    def progress(self, description: str, total: int | None) -> Iterator[ProgressTask]:
        if self.json_mode or self.quiet:
            yield ProgressTask(None, None)
            return
        if not self.err.is_terminal or self.err.is_dumb_terminal:
            # a log file or CI: a live bar would only show at the end; print a line every 10% or 15 s instead
            yield PlainProgress(self.err, description, total)
            return
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.err,
            transient=False,
        )
        with progress:
            task_id = progress.add_task(description, total=total, info="")
            yield ProgressTask(progress, task_id)


class ProgressTask:
    def __init__(self, progress: Progress | None, task_id: Any) -> None:
        self._progress = progress
        self._task_id = task_id

    def advance(self, n: float = 1, info: str | None = None) -> None:
        if self._progress is not None:
            if info is None:
                self._progress.advance(self._task_id, n)
            else:
                self._progress.update(self._task_id, advance=n, info=info)


class PlainProgress(ProgressTask):
    """Progress as plain lines (done/total, elapsed, ETA) for stderr that is not a terminal."""

    def __init__(self, console: Console, description: str, total: int | None, every_s: float = 15.0) -> None:
        super().__init__(None, None)
        self.console, self.description, self.total, self.every_s = console, description, total, every_s
        self.done = 0.0
        self.start = self._last = time.monotonic()
        self._last_tenth = 0

    def advance(self, n: float = 1, info: str | None = None) -> None:
        self.done += n
        now = time.monotonic()
        tenth = int(10 * self.done / self.total) if self.total else 0
        finished = self.total is not None and self.done >= self.total
        if tenth == self._last_tenth and now - self._last < self.every_s and not finished:
            return
        self._last, self._last_tenth = now, tenth
        elapsed = now - self.start
        line = f"{self.description}: {self.done:g}"
        if self.total:
            # a producer may pass its estimated total (a state cache's chunks overshoot it): no ETA below zero
            eta = elapsed * max(0.0, self.total - self.done) / self.done if self.done > 0 else float("nan")
            line += f"/{self.total} ({self.done / self.total:.0%}), {elapsed:.0f} s elapsed, ETA {eta:.0f} s"
        else:
            line += f", {elapsed:.0f} s elapsed"
        if info:
            line += f" {info}"
        self.console.print(line, markup=False, highlight=False)


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "__fspath__"):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
