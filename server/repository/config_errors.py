"""Config parse errors that name the place and the field, never the file's content.

A config file can be a symlink to any file the server can read, and its parse error reaches every
client through RepositoryIndex. protobuf's parsers quote the offending token or the whole line, so
their messages are never copied: the answer keeps the line and column, and names a field only when
it is a field of the ModelConfig schema (a word the schema supplies, not the file). An unknown field
gets the closest schema names as a suggestion instead of being echoed.
"""

from __future__ import annotations

import difflib
import re
from functools import cache

import yaml

from protos import model_config_pb2 as mc

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NO_FIELD = re.compile(r'has no field named "?([A-Za-z0-9_]+)')
_AT_PATH = re.compile(r'\bat "?(ModelConfig[A-Za-z0-9_.\[\]]*)')
_ENUM = re.compile(r'Enum type "([A-Za-z0-9_.]+)"')
_JSON_FIELD = re.compile(r"Failed to parse ([A-Za-z0-9_]+) field")
_PARSE_KIND = re.compile(r"Couldn't parse (integer|float|double|boolean|bool|string|enum)")


@cache
def schema_fields() -> frozenset[str]:
    """Every field name of ModelConfig and the messages it holds (proto and JSON spellings)."""
    names, seen, todo = set(), set(), [mc.ModelConfig.DESCRIPTOR]
    while todo:
        desc = todo.pop()
        if desc.full_name in seen:
            continue
        seen.add(desc.full_name)
        for field in desc.fields:
            names.update((field.name, field.json_name))
            if field.message_type is not None:
                todo.append(field.message_type)
    return frozenset(names)


def _suggest(unknown: str | None) -> str:
    close = difflib.get_close_matches(unknown or "", sorted(schema_fields()), n=2, cutoff=0.75)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def text_format_error(shown: str, exc, text: str) -> str:
    """`exc`: text_format.ParseError; `text`: the file, read only to find schema words on the bad line."""
    line, column = exc.GetLine(), exc.GetColumn()
    message = str(exc)
    where = f"{shown}: line {line}, column {column}" if line else shown
    unknown = _NO_FIELD.search(message)
    if unknown:
        return f"{where}: unknown field (not in the ModelConfig schema){_suggest(unknown.group(1))}"
    field = _field_on_line(text, line, column)
    named = f" in field '{field}'" if field else ""
    enum = _ENUM.search(message)
    if enum and "has no value named" in message:
        return f"{where}: value{named} is not a name of enum {enum.group(1)}"
    kind = _PARSE_KIND.search(message)
    if kind:
        return f"{where}: value{named} is not a valid {kind.group(1)}"
    return f"{where}: syntax error{named} (not valid protobuf text format)"


def _field_on_line(text: str, line: int, column: int) -> str | None:
    lines = text.splitlines()
    if not 1 <= line <= len(lines):
        return None
    before = lines[line - 1][: max(column - 1, 0)]
    known = [w for w in _IDENT.findall(before) if w in schema_fields()]
    return known[-1] if known else None


def json_format_error(shown: str, exc, text: str) -> str:
    """`exc`: json_format.ParseError from a YAML config; its paths and field names come from the schema."""
    message = str(exc)
    paths = _AT_PATH.findall(message)
    path = f" at {paths[-1].rstrip('.')}" if paths else ""
    unknown = _NO_FIELD.search(message)
    if unknown:
        line = _yaml_key_line(text, paths[-1] if paths else "ModelConfig", unknown.group(1))
        where = f"{shown}: line {line}" if line else shown
        return f"{where}: unknown field{path} (not in the ModelConfig schema){_suggest(unknown.group(1))}"
    fields = [f for f in _JSON_FIELD.findall(message) if f in schema_fields()]
    if fields:
        return f"{shown}: field '{fields[-1]}'{path} has a value of the wrong type or out of range"
    return f"{shown}: not a valid ModelConfig{path}"


def _yaml_key_line(text: str, path: str, key: str) -> int | None:
    """The line of mapping key `key` under `path` (as `ModelConfig.input[0]`), or None if not found."""
    try:
        node = yaml.compose(text)
        for part in re.findall(r"\.([A-Za-z0-9_]+)|\[(\d+)\]", path[len("ModelConfig"):]):
            node = _child(node, part[0]) if part[0] else node.value[int(part[1])]
        found = _child(node, key, keys=True)
    except (yaml.YAMLError, AttributeError, IndexError, TypeError, KeyError):
        return None
    return found.start_mark.line + 1


def _child(node, key: str, keys: bool = False):
    for k, v in node.value:
        if getattr(k, "value", None) == key:
            return k if keys else v
    raise KeyError(key)


def yaml_error(shown: str, exc) -> str:
    mark = getattr(exc, "problem_mark", None)
    where = f": line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{shown}{where}: not valid YAML"
