"""Bearer tokens and the two rights they grant: inference, and model control (admin).

Front-door neutral: gRPC reads the token from `authorization` metadata, HTTP from the `Authorization`
header, and both ask `authorize` the same question, so the two doors cannot disagree about who may
do what. Tokens are compared with hmac.compare_digest so the time taken does not reveal how much of
a guess was right. Model control needs the admin token: with only inference tokens configured, load
and unload are refused, so a leaked inference token can never change what the server serves.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

UNAUTHENTICATED, FORBIDDEN = "unauthenticated", "forbidden"


@dataclass(frozen=True, slots=True)
class Tokens:
    inference: tuple[bytes, ...] = ()  # grant inference, metadata, statistics, reflection, generation
    admin: tuple[bytes, ...] = ()  # grant all of that plus model control

    @property
    def enabled(self) -> bool:
        return bool(self.inference or self.admin)


@dataclass(frozen=True, slots=True)
class Denial:
    kind: str  # UNAUTHENTICATED (no or unknown token) or FORBIDDEN (valid token, not enough rights)
    message: str


def read_tokens(path: Path | None, env_value: str | None) -> tuple[bytes, ...]:
    """Tokens from a file (one a line; blank lines and `#` comments skipped) and an environment value."""
    lines = path.read_text().splitlines() if path is not None else []
    lines += (env_value or "").split(",")
    return tuple(t.strip().encode() for t in lines if t.strip() and not t.strip().startswith("#"))


def authorize(tokens: Tokens, authorization: str | bytes | None, control: bool) -> Denial | None:
    """None when `authorization` (the header's value) allows the call; the reason to refuse otherwise."""
    token = bearer(authorization)
    if token is None:
        return Denial(UNAUTHENTICATED, "this server requires a token: send 'authorization: Bearer <token>'")
    admin = _matches(token, tokens.admin)
    if not admin and not _matches(token, tokens.inference):
        return Denial(UNAUTHENTICATED, "the bearer token is not valid for this server")
    if control and not admin:
        return Denial(FORBIDDEN, "this call changes what the server serves or how it behaves (model load/unload, "
                                 "log or trace settings): it needs the admin token (--admin-token-file)")
    return None


def bearer(value: str | bytes | None) -> bytes | None:
    if value is None:
        return None
    value = value.decode(errors="replace") if isinstance(value, bytes) else value
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip().encode()
    return None


def _matches(token: bytes, accepted: tuple[bytes, ...]) -> bool:
    found = False
    for candidate in accepted:  # every candidate is compared, so timing does not tell which one matched
        found |= hmac.compare_digest(token, candidate)
    return found
