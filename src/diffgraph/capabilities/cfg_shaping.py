"""`cfg_shaping`'s declaration: its request parameters (the capability: models/families/zimage.py)."""

from ..capability_settings import Declaration

DECLARATION = Declaration("cfg_shaping", params=("cfg_truncation", "cfg_normalization"))
