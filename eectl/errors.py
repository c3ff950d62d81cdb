"""Domain errors. Raised deep in the library, mapped to a one-line message and an exit code once, in cli/app.py."""

from __future__ import annotations


class EectlError(Exception):
    """A user-facing failure: `message` is one line, `hint` says what to do about it."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(EectlError):
    """Bad arguments: out-of-range values, unknown names, inconsistent options."""

    exit_code = 2


class ModelLoadError(EectlError):
    """The model source is missing, not a model, corrupt, or of an unsupported architecture."""

    exit_code = 3


class DataError(EectlError):
    """The data source is missing, empty, or too small for what was asked."""

    exit_code = 4


class ArtifactError(EectlError):
    """An exported artifact is missing, edited, inconsistent, or failed its validation."""

    exit_code = 5


class OutputError(EectlError):
    """An output cannot be written: disk full, a read-only folder, a destination that is not ours to replace, or
    another eectl process writing it. Nothing half-written is left behind."""

    exit_code = 6
