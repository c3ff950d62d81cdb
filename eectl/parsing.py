"""Parsing what users hand eectl: every JSON and YAML input (manifest, calibration, recipe, prompt and data
files) goes through `parse_json` / `parse_yaml`, and every prompt through `check_text`, so that what Python's
parsers and the tokenizers raise on hostile input (RecursionError from deep nesting, ValueError from integers over
4,300 digits, NaN, TypeError from lone surrogates) is one line of the caller's error kind.

What this module does not do: read files (files.read_utf8 decodes them) or validate a document's fields (the
pydantic contracts do, once it is known to be a bounded tree of JSON values).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml

from eectl.errors import DataError, EectlError


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


MAX_DEPTH = 64  # nesting of any JSON / YAML input: eectl's own files nest under 10; deeper is refused


def _position(exc: Exception, line: int | None) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return (
            f"{exc.msg}: line {line} column {exc.colno}"
            if line
            else f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
        )
    return ""


def _parse_failure(exc: Exception) -> str:
    """What a parser's exception means, in a few words (no position)."""
    if isinstance(exc, RecursionError):
        return f"nested more than {MAX_DEPTH} levels deep"
    text = str(exc)
    if "integer string conversion" in text:  # sys.get_int_max_str_digits(): CPython refuses longer integers
        return f"an integer of more than {sys.get_int_max_str_digits()} digits"
    return text.splitlines()[0] if text.strip() else type(exc).__name__


def check_text(text: str, what: str, error: type[EectlError] = DataError) -> str:
    """`text` unchanged when it is text (encodes as UTF-8); else `error`, one line. Python hands over bytes that are not
    UTF-8 in argv and stdin as lone surrogates (U+DC80..U+DCFF, "surrogateescape"), and a JSON `"\\ud800"` escape
    is one: tokenizers fail on both with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        c = ord(text[exc.start])
        if 0xDC80 <= c <= 0xDCFF:  # an undecodable byte, escaped
            raise error(f"{what} is not UTF-8 text: byte 0x{c - 0xDC00:02x} at character {exc.start}") from None
        raise error(f"{what} holds a lone surrogate \\u{c:04x} at character {exc.start}, which is not text") from None
    return text


def check_document(doc: Any, what: str, error: type[EectlError], line: int | None = None) -> Any:
    """A parsed document's shape, checked without recursion: nested at most MAX_DEPTH levels (pydantic and the
    stages recurse over it), and no string holding a lone surrogate (`"\\ud800"` is valid JSON but not text:
    tokenizers and every UTF-8 writer fail on it)."""
    where = f": line {line}" if line else ""
    todo: list[tuple[Any, int]] = [(doc, 0)]
    while todo:
        x, depth = todo.pop()
        if isinstance(x, dict):
            todo += [(k, depth + 1) for k in x] + [(v, depth + 1) for v in x.values()]
        elif isinstance(x, list | tuple):
            todo += [(v, depth + 1) for v in x]
        elif isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise error(
                    f"{what}: a string holds a lone surrogate \\u{ord(x[exc.start]):04x}, which is not text{where}"
                ) from None
            continue
        else:
            continue
        if depth >= MAX_DEPTH:
            raise error(f"{what}: nested more than {MAX_DEPTH} levels deep{where}")
    return doc


def parse_json(text: str, what: str, error: type[EectlError], line: int | None = None) -> Any:
    """The one parser of eectl's JSON inputs: strict (no NaN / Infinity), then `check_document`; every failure is
    one line `error(f"{what}: <why>")`, with the line (of a JSON Lines file) or line and column where it has one.
    RecursionError (deep nesting) and CPython's integer-digits limit are failures like any other."""
    try:
        doc = json.loads(text, parse_constant=_refuse_constant)  # strict: NaN, Infinity refused
    except json.JSONDecodeError as exc:
        raise error(f"{what}: {_position(exc, line)}") from None
    except (ValueError, RecursionError) as exc:
        raise error(f"{what}: {_parse_failure(exc)}" + (f": line {line}" if line else "")) from None
    return check_document(doc, what, error, line)


def parse_yaml(text: str, what: str, error: type[EectlError]) -> Any:
    """YAML through yaml.safe_load (no tags that build objects), with the failures `parse_json` maps."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{what}: {str(exc).splitlines()[0]}") from None
    except (ValueError, RecursionError) as exc:  # a deep document; an integer over the digits limit
        raise error(f"{what}: {_parse_failure(exc)}") from None
    return check_document(doc, what, error)
