"""AUTOMATIC1111's prompt styles: a styles CSV (`name,prompt,negative_prompt`, a header row, quoted CSV; its older
`name,text` header too) read whole and bounded at start (`read_styles`), and the styles a request names applied to
its prompt and negative prompt in order (`StyleBook.apply`), as its modules/styles.py applies them: a style's text
that holds `{prompt}` takes the prompt there, any other is appended to it after ", " (an empty side adds no comma).

Standard library only: the server's settings check the file with it (config.py), the AUTOMATIC1111 routes apply and
list it (server/a1111_protocol.py, a1111_info.py).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from typing import Any, Sequence

MAX_STYLES_BYTES = 1 << 20  # the most bytes a styles file may hold
PLACEHOLDER = "{prompt}"


class StyleError(ValueError):
    """A styled prompt over its limit; `field` is the request's field that grew ("prompt" or "negative_prompt")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class PromptStyle:
    name: str
    prompt: str
    negative_prompt: str


def merge(style: str, prompt: str) -> str:
    """One style's text applied to a prompt: `{prompt}` replaced by it, else the two joined by ", " (each stripped,
    an empty one left out)."""
    if PLACEHOLDER in style:
        return style.replace(PLACEHOLDER, prompt)
    return ", ".join(part for part in (prompt.strip(), style.strip()) if part)


def _merged(style: str, prompt: str, limit: int | None) -> str | None:
    """`merge(style, prompt)`, or None when `{prompt}` would make it longer than `limit` characters (counted before
    it is built: a style that repeats `{prompt}` multiplies the prompt; an appended style adds only its own text)."""
    count = style.count(PLACEHOLDER)
    if limit is not None and count and len(style) + count * (len(prompt) - len(PLACEHOLDER)) > limit:
        return None
    return merge(style, prompt)


@dataclass(frozen=True)
class StyleBook:
    """The styles of one file, by name (a later row of the same name replaces an earlier one in place, as
    AUTOMATIC1111's dict of styles does)."""

    path: str
    styles: tuple[PromptStyle, ...]

    def listing(self) -> list[dict[str, str]]:
        """GET /sdapi/v1/prompt-styles: AUTOMATIC1111's PromptStyleItem list."""
        return [{"name": s.name, "prompt": s.prompt, "negative_prompt": s.negative_prompt} for s in self.styles]

    def apply(self, prompt: str, negative_prompt: str, names: Sequence[str],
              max_bytes: int | None = None) -> tuple[str, str, tuple[str, ...]]:
        """(prompt, negative prompt, the names not in the file) after the named styles, in order; a name not in the
        file is skipped. With `max_bytes`, a StyleError when a styled prompt grows past it (UTF-8)."""
        by_name = {s.name: s for s in self.styles}
        unknown = tuple(dict.fromkeys(n for n in names if n not in by_name))
        texts = {"prompt": prompt, "negative_prompt": negative_prompt}
        for style in (by_name[n] for n in names if n in by_name):
            for field in texts:
                merged = _merged(getattr(style, field), texts[field], max_bytes)
                size = None if merged is None or max_bytes is None else len(merged.encode("utf-8", "surrogatepass"))
                if merged is None or (size is not None and size > max_bytes):
                    raise StyleError(field, f"{field} with style {style.name!r} applied is longer than {max_bytes} bytes "
                                            "(UTF-8, --max-prompt-bytes): send a shorter prompt or fewer styles")
                texts[field] = merged
        return texts["prompt"], texts["negative_prompt"], unknown


def _fail(path: str, where: str, why: str) -> ValueError:
    return ValueError(f"styles {path!r}{where}: {why}; AUTOMATIC1111's styles.csv has a header row name,prompt,"
                      "negative_prompt and one style a row, a field holding a comma or a newline in double quotes")


def _style(path: str, row: dict[Any, Any], line: int, width: int) -> PromptStyle | None:
    """One data row's style (None for a blank or `#` comment row); a ValueError naming the line otherwise."""
    if None in row:
        raise _fail(path, f", line {line}", f"the row has {width + len(row[None])} fields, the header {width}")
    name = row["name"] or ""
    if name.startswith("#") or not any((v or "").strip() for v in row.values()):
        return None
    prompt = row.get("prompt", row.get("text"))
    if prompt is None:
        raise _fail(path, f", line {line}", f"style {name!r} has no prompt field")
    return PromptStyle(name, prompt, row.get("negative_prompt") or "")


def read_styles(path: str) -> StyleBook:
    """The styles of the CSV file at `path` (UTF-8, a BOM allowed, at most MAX_STYLES_BYTES); a one-line ValueError
    naming the file, and the line of a malformed row, otherwise."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_STYLES_BYTES + 1)
    except OSError as e:
        raise _fail(path, "", f"cannot be read ({e.strerror or type(e).__name__})") from None
    if len(data) > MAX_STYLES_BYTES:
        raise _fail(path, "", f"larger than {MAX_STYLES_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise _fail(path, "", f"not UTF-8 text (byte {e.start})") from None
    reader = csv.DictReader(io.StringIO(text, newline=""), skipinitialspace=True, strict=True)
    found: dict[str, PromptStyle] = {}
    try:
        header = reader.fieldnames or []
        if header and ("name" not in header or not {"prompt", "text"} & set(header)):
            raise _fail(path, ", line 1", f"the header {','.join(header)!r} lacks the name or prompt column")
        for row in reader:
            style = _style(path, row, reader.line_num, len(header))
            if style is not None:
                found[style.name] = style
    except csv.Error as e:  # the reader's count stops at the last whole row: the bad one starts on the next line
        raise _fail(path, f", line {reader.line_num + 1}", f"not CSV ({e})") from None
    return StyleBook(path, tuple(found.values()))
