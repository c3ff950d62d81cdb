"""One Output object for every command: rich tables for people, one JSON document on stdout with --json.

Progress bars, logs and hints go to stderr; in JSON mode progress is off so stdout stays machine-readable.
"""

from __future__ import annotations

import json
import sys
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


class Output:
    def __init__(self, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        self.out = Console(file=sys.stdout, soft_wrap=True)
        self.err = Console(file=sys.stderr, soft_wrap=True)

    def log(self, message: str) -> None:
        """A progress or status line for people: stderr, silent in JSON mode."""
        if not self.json_mode and not self.quiet:
            self.err.print(message)

    def warn(self, message: str) -> None:
        self.err.print(f"[yellow]warning:[/yellow] {message}")

    def table(self, title: str, columns: list[str], rows: Iterable[Iterable[Any]]) -> None:
        if self.json_mode:
            return
        table = Table(title=title)
        for col in columns:
            table.add_column(col, justify="right" if col != columns[0] else "left")
        for row in rows:
            table.add_row(*[str(c) for c in row])
        self.out.print(table)

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


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "__fspath__"):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
