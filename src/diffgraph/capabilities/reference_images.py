"""`reference_images`' declaration: its request parameter (the capabilities: models/families/flux2_refs.py,
qwen_image_edit.py, on references.py)."""

from ..capability_settings import Declaration, RequestFlag

DECLARATION = Declaration("reference_images", flags=(RequestFlag(
    "reference_images", flag="--reference-image", metavar="PATH", images=True,
    help="a reference image (repeatable) for a model that takes them: FLUX.2 klein's references (up to 4, e.g. the "
         "character to keep), Qwen-Image-Edit's input images (up to 3, the images to edit)"),))
