"""Request bodies, read within their limits as they arrive: a JSON body, and the multipart form of the edits route.

Every limit holds while the body streams, whether it came with a Content-Length or chunked: a declared length past
the limit is refused before a byte is read, and a body that runs past it is refused at the byte that crosses it,
never spooled first and measured after. A multipart form is parsed here, in memory, part by part (python-multipart's
parser, the one Starlette uses), with its parts bounded in count and size as they open: a file part is never stored
past its limit. Refusals are APIErrors: 413 for a body past its limit; 400 for a form that is malformed (cut off
before its closing boundary, a text field not UTF-8) or has too many parts, or a file part over its limit once the
whole (declared, bounded) body has been read, so that the answer can name the part's size; a chunked body's file
part over its limit is a 413 at once, since no bound on what would follow it is known. A client that leaves while
sending is ClientGone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import ClientDisconnect

from ..api.protocol import APIError
from .requests import ClientGone

try:
    from python_multipart.exceptions import FormParserError
    from python_multipart.multipart import MultipartParser, parse_options_header
except ImportError:  # pragma: no cover - python-multipart before 0.0.13
    from multipart.exceptions import FormParserError  # type: ignore[no-redef]
    from multipart.multipart import MultipartParser, parse_options_header  # type: ignore[no-redef]

MAX_FIELD_BYTES = 1_048_576  # a text field of a form (the prompt is bounded again by --max-prompt-bytes)


async def body_chunks(http: Any, limit: int, hint: str = "") -> AsyncIterator[bytes]:
    """The body's chunks, refused with 413 the moment it is known to pass `limit` bytes (`hint` ends the message:
    the flag that sets the limit)."""
    length = http.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise APIError(413, f"the body has {length} bytes; the limit is {limit}{hint}", code="body_too_large")
    size = 0
    try:
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the body exceeds {limit} bytes{hint}", code="body_too_large")
            yield chunk
    except ClientDisconnect:  # the client left while sending its body
        raise ClientGone() from None


async def read_body(http: Any, limit: int) -> bytes:
    return b"".join([chunk async for chunk in body_chunks(http, limit)])


@dataclass
class FormLimits:
    """What a multipart form may hold: the body, its file parts (by name) and its text fields."""

    body_bytes: int
    file_names: tuple[str, ...]
    file_bytes: int
    flag: str = ""               # the flag that sets file_bytes, named in the messages
    max_fields: int = 64
    field_bytes: int = MAX_FIELD_BYTES


async def read_json(http: Any, limit: int) -> Any:
    """A JSON body of at most `limit` bytes, parsed. Raises APIError (400 not JSON, 413 past the limit)."""
    body = await read_body(http, limit)
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the body is not valid JSON ({e}); send a JSON object such as "
                            "{\"prompt\": \"a red fox\"}", code="invalid_json") from None


def _named(flag: str) -> str:
    return f" ({flag})" if flag else ""


class _Part:
    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] = {}
        self.name = ""
        self.is_file = False
        self.data = bytearray()
        self.size = 0  # bytes the part had, stored or not


class _FormReader:
    """python-multipart's callbacks: each part's headers, then its data within its bound."""

    def __init__(self, limits: FormLimits, declared: bool):
        self.limits, self.declared = limits, declared
        self.parts: list[_Part] = []
        self.part = _Part()
        self.header_name = self.header_value = b""
        self.files = self.fields = 0
        self.oversized: _Part | None = None  # the first file part over its limit (read to the end, not stored)
        self.ended = False  # the closing boundary was read (a form cut off before it lacks its last part)

    def on_part_begin(self) -> None:
        self.part = _Part()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        self.part.headers[self.header_name.lower()] = self.header_value
        self.header_name = self.header_value = b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self.part.headers.get(b"content-disposition", b""))
        if b"name" not in options:
            raise APIError(400, "a form part has no name in its Content-Disposition header", code="invalid_form")
        part, limits = self.part, self.limits
        part.name = options[b"name"].decode("utf-8", "replace")
        part.is_file = b"filename" in options
        if part.is_file:
            self.files += 1
            if self.files > len(limits.file_names):
                raise APIError(400, f"the form has more than {len(limits.file_names)} file parts; send at most "
                                    f"{', '.join(limits.file_names)}", param=part.name, code="invalid_form")
        else:
            self.fields += 1
            if self.fields > limits.max_fields:
                raise APIError(400, f"the form has more than {limits.max_fields} text fields", code="invalid_form")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        part, limits = self.part, self.limits
        part.size += end - start
        bound = limits.file_bytes if part.is_file else limits.field_bytes
        if part.size <= bound:
            part.data += data[start:end]
            return
        if not part.is_file:
            raise APIError(400, f"{part.name} has more than {bound} bytes; a text field holds at most {bound}",
                           param=part.name)
        if not self.declared:  # chunked: nothing bounds what follows but the body limit, so stop here
            raise APIError(413, f"{part.name} has more than {bound} bytes; the limit is {bound}"
                                f"{_named(limits.flag)}", param=part.name, code="image_too_large")
        part.data = bytearray()  # read on (the declared length is within the body limit) without storing it
        self.oversized = self.oversized or part

    def on_part_end(self) -> None:
        if not self.part.is_file:
            try:
                self.part.data.decode("utf-8")
            except UnicodeDecodeError:
                raise APIError(400, f"{self.part.name} is not UTF-8 text; send the form's text fields in UTF-8",
                               param=self.part.name, code="invalid_form") from None
        self.parts.append(self.part)

    def on_end(self) -> None:
        self.ended = True


async def read_multipart(http: Any, limits: FormLimits) -> list[tuple[str, str | bytes]]:
    """The form's parts in order: (name, text) for a text field, (name, bytes) for a file part."""
    _, params = parse_options_header(http.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if not boundary:
        raise APIError(400, "the multipart form has no boundary in its Content-Type", code="invalid_form")
    declared = http.headers.get("content-length", "").isdigit()
    reader = _FormReader(limits, declared)
    callbacks = {name: getattr(reader, name) for name in (
        "on_part_begin", "on_header_field", "on_header_value", "on_header_end", "on_headers_finished",
        "on_part_data", "on_part_end", "on_end")}
    try:
        parser = MultipartParser(boundary, callbacks)
        hint = _named(limits.flag and f"{limits.flag} {limits.file_bytes} per file")
        async for chunk in body_chunks(http, limits.body_bytes, hint):
            parser.write(chunk)
        parser.finalize()
    except FormParserError as e:
        raise APIError(400, f"the multipart form could not be read: {e}", code="invalid_form") from None
    if not reader.ended:
        raise APIError(400, "the multipart form ends before its closing boundary (--BOUNDARY--): its last part may "
                            "be cut off; send the whole form", code="invalid_form")
    if reader.oversized is not None:
        part = reader.oversized
        raise APIError(400, f"{part.name} has {part.size} bytes; the limit is {limits.file_bytes}"
                            f"{_named(limits.flag)}", param=part.name, code="image_too_large")
    return [(p.name, bytes(p.data) if p.is_file else p.data.decode("utf-8")) for p in reader.parts]
