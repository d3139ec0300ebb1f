"""`weights_view`: a user's diffusers or transformers folder as `from_pretrained` should read it, through private
copies of the weights it reads (`safe_files.private_view`); and the rules both that and `stream_load` follow (which
weights files a folder's loader reads, the `UnreadableWeights` error).

Both libraries memory-map safetensors, and on the CPU at the file's dtype the parameters stay views of that map: a
weights file cut or rewritten in place (`cp new old`, `rsync --inplace`) while or after it loads would kill the
process with SIGBUS. Component folders with safetensors weights are streamed instead (`stream_load.load_part`); a
folder that `from_pretrained` must still read (pickle `.bin` weights only) goes through here: the weights
`from_pretrained` would read are copied (`weights_read`: the plain files, else the fp16 variant's; safetensors where
there are any), the other weights files are hidden from it, and everything else is linked. A file that cannot be
copied (changed while it was read, truncated, a FIFO) is an `UnreadableWeights` naming it. The copies cost host
memory the size of the files read, while the module loads (for as long as its parameters stay on the CPU at the
file's dtype, it is their memory).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterable, Iterator

from .. import safe_files

MODEL_FILE_LIMIT = 1 << 40  # bytes per weights file (a 1 TB sparse file is refused by its size, before it is read)
WEIGHTS_EXT = (".safetensors", ".bin")


class UnreadableWeights(ValueError):
    """A weights file (or a JSON file) of a folder could not be read; the message names the folder's owner, the file
    and the fix."""


def weights_group(weights: list[str]) -> list[str]:
    """Of a component folder's weights files, those from_pretrained reads: the plain files, else the fp16 variant's
    (the family's `variant` rule); safetensors where there are any, else .bin (both libraries prefer safetensors)."""
    group = [f for f in weights if f.count(".") == 1] or [f for f in weights if ".fp16." in f] or weights
    return [f for f in group if f.endswith(".safetensors")] or group


def weights_read(folder: str, components: Iterable[str] | None = None) -> tuple[list[str], list[str]]:
    """The weights files (relative paths) that from_pretrained reads from each component folder, to copy, and the
    other weights files there, to hide from it. `components`: the folders read, relative to `folder` ("." for the
    folder itself); default every subfolder (a pipeline folder's). Copying only these keeps a folder that also holds
    .bin or variant copies from costing several times its model in memory."""
    if components is None:
        components = [sub for sub in sorted(os.listdir(folder)) if os.path.isdir(os.path.join(folder, sub))]
    copies, omit = [], []
    for sub in components:
        path = os.path.join(folder, sub)
        weights = sorted(f for f in os.listdir(path) if f.endswith(WEIGHTS_EXT))
        group = weights_group(weights)
        copies += [os.path.normpath(os.path.join(sub, f)) for f in group]
        omit += [os.path.normpath(os.path.join(sub, f)) for f in weights if f not in group]
    return copies, omit


def unreadable(label: str, rel: str, e: safe_files.UnusableFile) -> UnreadableWeights:
    """The error for a weights file `rel` of the folder `label` names that could not be read (`e` says why)."""
    again = "wait until it is written completely, or copy it again" if isinstance(e, safe_files.FileChanged) \
        else "copy or download that file again"
    return UnreadableWeights(f"{label}: {rel} {e}; {again}")


@contextmanager
def weights_view(folder: str, label: str, components: Iterable[str] | None = None) -> Iterator[str]:
    """A folder to hand to from_pretrained in place of `folder` while the block runs (`weights_read` says which
    `components` are copied). `label` names the folder in errors ("model folder '/m'", "ControlNet 'edges'"): a
    weights file that cannot be copied raises UnreadableWeights("{label}: {file} {why}; {fix}"), and a ValueError or
    OSError from the block that names the view names `folder` instead."""
    copies, omit = weights_read(folder, components)
    with safe_files.private_view(folder, copies, omit, MODEL_FILE_LIMIT, lambda rel, e: unreadable(label, rel, e)) \
            as view:
        try:
            yield view
        except (OSError, ValueError) as e:  # the libraries' messages name the folder they read: the user's, not ours
            if view not in str(e):
                raise
            raise ValueError(str(e).replace(view, folder)) from None
