"""Names and versions as clients send them: checked once, and echoed short.

Every error message that repeats something a client sent goes through `shown`, so a 100 KB model
or input name costs the client a short INVALID_ARGUMENT or NOT_FOUND, never a status message that
outgrows its metadata limit (which the client reports as RESOURCE_EXHAUSTED, hiding the real error).
Model names double as folder names in the repository, so `check_model_name` refuses anything that
could step outside it before any path is built.
"""

from __future__ import annotations

import os
import re

from server.errors import InvalidInputError

SHOWN_CHARS = 100
MAX_MESSAGE_CHARS = 4096  # the backstop for a whole status message (rpc/errors.py)
# str.isdigit() accepts '²', '①' and '١' (int('١') == 1): versions are ASCII digits only, and at most
# 18 of them, so int() is cheap and the value fits the int64 that metadata and statistics carry.
_VERSION = re.compile(r"[0-9]{1,18}")
_MAX_NAME_BYTES = 255  # a model name is a folder name: longer names cannot exist on disk


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` quoted, cut to `limit` characters with its full length noted when longer."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} chars)"


def capped(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """A whole message cut to `limit` characters; used where a message joins many client strings."""
    return message if len(message) <= limit else f"{message[:limit]}... ({len(message)} chars in all)"


def parse_version(text: str) -> int:
    """A request's version string ('' is handled by the caller) as an int; INVALID_ARGUMENT otherwise."""
    if not _VERSION.fullmatch(text):
        # Triton's words first: its example clients match on them
        raise InvalidInputError(f"failed to get model version from specified version string {shown(text)}: "
                                "a version must be a non-negative integer in ASCII digits")
    return int(text)


def is_version_folder(name: str) -> bool:
    return _VERSION.fullmatch(name) is not None


def check_model_name(name: str) -> None:
    """Refuse names that are not a plain folder of the repository, before any path is built from them."""
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    why = ""
    if not name:
        why = "is empty"
    elif name in (".", "..") or name.startswith((".", "__")):
        why = "starts with '.' or '__' (such folders are never models)"
    elif any(s in name for s in seps) or "\0" in name or os.path.isabs(name):
        why = "contains a path separator or NUL; a model name is one folder of the model repository"
    elif len(name.encode()) > _MAX_NAME_BYTES:
        why = f"is longer than a folder name can be ({_MAX_NAME_BYTES} bytes)"
    if why:
        raise InvalidInputError(f"model name {shown(name)} {why}")
