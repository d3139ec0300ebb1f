"""Known third-party warnings that say nothing to a diffgraph user, filtered where they arise, by logger and
message (never a global ignore):

- transformers warns once per image-processor class, on importing a diffusers pipeline, that torchvision is not
  installed and it falls back to the PIL processor: diffgraph uses no image processor.
- diffusers warns on every `.to(dtype)` of a model that "modules should be kept in float32: []": the list is
  empty, nothing is cast that should not be.
"""

from __future__ import annotations

import logging

KNOWN = (
    ("transformers.utils.import_utils", "requires torchvision (not installed); falling back to"),
    ("diffusers.models.modeling_utils", "that should be kept in float32: []."),
)


class _KnownMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_known_warnings() -> None:
    """Installs the filters (once per logger; calling again changes nothing)."""
    for name, text in KNOWN:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _KnownMessage) and f.text == text for f in logger.filters):
            logger.addFilter(_KnownMessage(text))
