"""Read a request body within the size limit, undoing the request compression tritonclient sends.

The limit is Triton's --http-max-input-size (64 MiB by default, never above gRPC's --max-message-bytes),
applied to the body as it arrives and again to what decompression yields, so neither a large upload nor
a small gzip bomb can make the server hold more than the limit. The tensors a body's JSON decodes to are
held to it too (tensors.decode_infer, generate_tensors), since JSON expands: "1," is an 8-byte INT64.
"""

from __future__ import annotations

import zlib

from starlette.requests import Request

from server.errors import InvalidInputError

_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class BodyTooLargeError(InvalidInputError):
    """The body (or what it decompresses to) is over the server's limit: 413."""


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError(f"request size of {declared} bytes exceeds the maximum allowed input size of {limit} bytes; "
                                f"this server accepts at most {limit} (--http-max-input-size)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError(f"request size of over {limit} bytes exceeds the maximum allowed input size of {limit} "
                                    f"bytes; this server accepts at most {limit} (--http-max-input-size)")
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding == "identity" or not body:
        return body
    if encoding not in _WBITS:
        raise InvalidInputError(f"unsupported Content-Encoding {encoding!r}; send gzip, deflate or identity")
    return _decompress(body, encoding, limit)


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    inflater = zlib.decompressobj(_WBITS[encoding])
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidInputError(f"the request body is not valid {encoding} data: {exc}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise BodyTooLargeError(f"the request body decompresses to over {limit} bytes, the most this server accepts")
    if not inflater.eof:
        raise InvalidInputError(f"the request body's {encoding} data is truncated")
    return out
