"""`ParamError`: the one error a bad request parameter raises, from validation to the engine (a 400 at the HTTP edge);
`ModelLoadError`: a model of a model set that could not be loaded (torch-free: it crosses from a replica process);
`relative_paths`: a message as a client may see it, with the paths under a served folder relative to it.

Its own module so that what validates a request's parts (request.py, text/) shares it without importing each other.
"""

from __future__ import annotations

import os


class ParamError(ValueError):
    """A request parameter is invalid. `param` names it as GenerationRequest spells it (num_images, width, ...);
    the message names the value and what is allowed."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # picklable with both arguments (across a replica process boundary)
        return (type(self), (self.param, str(self)))


class ModelLoadError(ValueError):
    """The model could not be loaded (its file, its architecture); the message says why, in one line."""


def unknown_hint(name: str, names: list[str]) -> str:
    """"; did you mean ...?" with the names close to `name`, else "; known: ..." (the first ten)."""
    import difflib
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    return (f"; did you mean {', '.join(repr(c) for c in close)}?" if close
            else f"; known: {', '.join(names[:10]) or 'none'}")


def relative_paths(message: str, *folders: str) -> str:
    """`message` with the paths under each of `folders` written relative to it ("/srv/models/sd/a.safetensors" ->
    "sd/a.safetensors") and the folder itself as ".": what a client is told names files as it names them, never where
    the server keeps them (the server's own log has whole paths). Folders match as given and as their real paths."""
    roots = {p for folder in folders for p in (os.path.abspath(folder), os.path.realpath(folder))}
    for root in sorted(roots, key=len, reverse=True):  # (a folder inside another: the inner one first)
        message = message.replace(root.rstrip(os.sep) + os.sep, "").replace(root, ".")
    return message
