"""Triton's --grpc-header-forward-pattern / --http-header-forward-pattern: request headers whose name
matches a pattern become string request parameters, which the model reads as any other parameter.

The pattern matches anywhere in the name (a partial match) and ignores case unless it starts with
`(?-i)`, as Triton's RE2 patterns do. A matching header named as one of Triton's reserved parameter keys
(or starting with `triton_`) is refused, since forwarding it would let a header steer the server.
"""

from __future__ import annotations

import re
from typing import Iterable

from server.errors import InvalidInputError

RESERVED = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers", "binary_data_output"})
_CASE_SENSITIVE = "(?-i)"


class HeaderForward:
    def __init__(self, pattern: str):
        if pattern.startswith(_CASE_SENSITIVE):
            self.regex = re.compile(pattern[len(_CASE_SENSITIVE):])
        else:
            self.regex = re.compile(pattern, re.IGNORECASE)

    def parameters(self, headers: Iterable[tuple[str, str]]) -> dict[str, str]:
        """The parameters the matching headers make; raises InvalidInputError for a reserved name."""
        out = {}
        for name, value in headers:
            if not self.regex.search(name):
                continue
            if name in RESERVED or name.startswith("triton_"):
                raise InvalidInputError(f"Header '{name}' is reserved for Triton usage and cannot be forwarded.")
            out[name] = value if isinstance(value, str) else bytes(value).decode("utf-8", "replace")
        return out


def header_forward(pattern: str | None) -> HeaderForward | None:
    """None when no pattern is set (the default: no header is forwarded)."""
    if not pattern:
        return None
    try:
        return HeaderForward(pattern)
    except re.error as exc:
        raise ValueError(f"header forward pattern {pattern!r} is not a valid regular expression: {exc}") from None
