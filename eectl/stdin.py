"""Standard input and command-line arguments as UTF-8 text, whatever the locale: what `eectl run` reads as its
prompt (`ARG`, `-`, `--prompt-file -`) and its `--chat` turns. Closed or unreadable standard input is one line of
the caller's error kind, not an AttributeError or OSError traceback.

What this module does not do: check the text (parsing.check_text refuses what is not UTF-8, naming the byte).
"""

from __future__ import annotations

import os
import sys
from typing import IO

from eectl.errors import EectlError, UsageError
from eectl.files import clean_text, decode_utf8


def read_stdin(error: type[EectlError] = UsageError) -> str:
    """Standard input read as bytes and decoded like a file (`read_utf8`), whatever the locale's encoding: a strict
    UTF-8 locale would otherwise raise UnicodeDecodeError on the first bad byte, a C locale pass it on. Closed
    (`0<&-`: Python's sys.stdin is None) or unreadable (a folder, EBADF): `error`, one line."""
    stream = stdin_stream(error)
    buffer = getattr(stream, "buffer", None)
    try:
        if buffer is None:  # a text-only stream (tests, embedding): already decoded
            return clean_text(stream.read())
        return decode_utf8(buffer.read(), "standard input", error)
    except OSError as exc:
        raise error(f"cannot read standard input: {exc.strerror or exc}") from None


def stdin_stream(error: type[EectlError] = UsageError) -> IO[str]:
    """sys.stdin, or `error` (one line) where the process was started with it closed."""
    if sys.stdin is None:
        raise error("standard input is closed", hint="pipe the text in, or give it as an argument or a file")
    return sys.stdin


def read_line(error: type[EectlError] = UsageError) -> str | None:
    """One line of standard input (a --chat turn) decoded as UTF-8 whatever the locale (a C locale's ASCII would
    refuse a UTF-8 turn), without a byte-order mark; None at its end. Closed or unreadable: `error`, one line."""
    stream = stdin_stream(error)
    buffer = getattr(stream, "buffer", None)
    try:
        if buffer is None:  # a text-only stream (tests, embedding): already decoded
            line = stream.readline()
            return clean_text(line) if line else None
        raw = buffer.readline()
    except OSError as exc:
        raise error(f"cannot read standard input: {exc.strerror or exc}") from None
    if not raw:
        return None
    return clean_text(raw.decode("utf-8", errors="surrogateescape"))  # a bad byte: check_text names it


def argument_text(value: str) -> str:
    """A command-line argument as the UTF-8 text its bytes spell. Python decodes argv with the locale's encoding: in
    a C locale without UTF-8 mode (PYTHONUTF8=0) that is ASCII, each other byte escaped as a lone surrogate, so a
    valid UTF-8 prompt was refused as "not UTF-8 text". Bytes that are not UTF-8 stay escaped (check_text names
    them)."""
    return os.fsencode(value).decode("utf-8", errors="surrogateescape")
