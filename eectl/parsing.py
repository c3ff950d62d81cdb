"""Parsing what users hand eectl: every JSON and YAML input (manifest, calibration, recipe, prompt and data
files) goes through `parse_json` / `parse_yaml`, and every prompt through `check_text`, so that what Python's
parsers and the tokenizers raise on hostile input (RecursionError from deep nesting, ValueError from integers over
4,300 digits, NaN, TypeError from lone surrogates) is one line of the caller's error kind. Both parsers refuse a key
given twice in one mapping (json and PyYAML keep the last value, silently), and a YAML document whose aliases
expand it past MAX_VALUES values (an alias bomb: nine levels of nine references took 25 s to fail downstream).

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
# values (scalars, lists and mappings) of a YAML document once its aliases are expanded: eectl's recipes hold ~100;
# the bound is what pydantic and the stages would otherwise walk (an alias bomb is billions)
MAX_VALUES = 100_000


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


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):  # json.loads keeps the last value of a key given twice, silently
        twice = next(k for i, (k, _) in enumerate(pairs) if any(k == k2 for k2, _ in pairs[:i]))
        raise ValueError(f"the key {twice!r} is given twice in one object")
    return doc


def parse_json(text: str, what: str, error: type[EectlError], line: int | None = None) -> Any:
    """The one parser of eectl's JSON inputs: strict (no NaN / Infinity, no key twice in an object), then
    `check_document`; every failure is one line `error(f"{what}: <why>")`, with the line (of a JSON Lines file) or
    line and column where it has one. RecursionError (deep nesting) and CPython's integer-digits limit are failures
    like any other."""
    try:
        doc = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise error(f"{what}: {_position(exc, line)}") from None
    except (ValueError, RecursionError) as exc:
        raise error(f"{what}: {_parse_failure(exc)}" + (f": line {line}" if line else "")) from None
    return check_document(doc, what, error, line)


class _Loader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last value, silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if isinstance(key, list | dict):
                continue  # unhashable: SafeLoader's own error names it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _expanded_values(node: yaml.Node, limit: int) -> int:
    """How many values the composed YAML `node` stands for once its aliases are expanded (each alias counts its
    anchor's values again), counted without expanding anything and stopped past `limit`. The composer shares an
    aliased node; counting per distinct node object keeps this linear in the document's text."""
    sizes: dict[int, int] = {}
    order: list[tuple[yaml.Node, bool]] = [(node, False)]
    while order:  # iterative post-order: a deep document cannot overflow the stack
        n, done = order.pop()
        if id(n) in sizes:
            continue
        children: list[yaml.Node] = []
        if isinstance(n, yaml.SequenceNode):
            children = list(n.value)
        elif isinstance(n, yaml.MappingNode):
            children = [x for pair in n.value for x in pair]
        if done or not children:
            sizes[id(n)] = min(limit + 1, 1 + sum(sizes[id(c)] for c in children))
            continue
        order.append((n, True))
        order += [(c, False) for c in children if id(c) not in sizes]
    return sizes[id(node)]


def parse_yaml(text: str, what: str, error: type[EectlError]) -> Any:
    """YAML through a yaml.SafeLoader (no tags that build objects; no key twice in a mapping; at most MAX_VALUES
    values once aliases are expanded, counted before anything is built), with the failures `parse_json` maps."""
    try:
        loader = _Loader(text)
        try:
            node = loader.get_single_node()  # type: ignore[no-untyped-call]
            if node is not None and _expanded_values(node, MAX_VALUES) > MAX_VALUES:
                raise error(f"{what}: its aliases expand it to more than {MAX_VALUES} values")
            doc = loader.construct_document(node) if node is not None else None  # type: ignore[no-untyped-call]
        finally:
            loader.dispose()  # type: ignore[no-untyped-call]
    except yaml.YAMLError as exc:
        raise error(f"{what}: {str(exc).splitlines()[0]}") from None
    except (ValueError, RecursionError) as exc:  # a deep document; an integer over the digits limit
        raise error(f"{what}: {_parse_failure(exc)}") from None
    return check_document(doc, what, error)
