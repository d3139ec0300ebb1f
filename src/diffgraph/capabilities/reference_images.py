"""`reference_images`' declaration: its request parameter (the capability: models/families/flux2_refs.py)."""

from ..capability_settings import Declaration, RequestFlag

DECLARATION = Declaration("reference_images", flags=(RequestFlag(
    "reference_images", flag="--reference-image", metavar="PATH", images=True,
    help="a reference image (repeatable, up to 4) for a model that takes them (FLUX.2 klein: the request's "
         "reference_images, e.g. the character to keep)"),))
