"""Control maps, torch-free (the HTTP process shows them before a request is sent): a control's image
through its preprocessor (`control_map`: none, canny with OpenCV imported only then, invert), fitted to the output
size by AUTOMATIC1111's resize modes (`fit_map`). The engine prepares the fitted map as diffusers' ControlNet
pipelines prepare theirs (engine/controlnets.py), so what the playground shows is what the ControlNet sees.

Resize modes: "just_resize" stretches the map to the size (diffusers' `VaeImageProcessor.resize`: Lanczos);
"crop_and_resize" covers the size, aspect kept, and crops the centre (diffusers' resize_mode "crop", the same
arithmetic); "resize_and_fill" fits inside it, aspect kept, centred on the median colour of the map's border
(AUTOMATIC1111's ControlNet extension's "Resize and Fill").
"""

from __future__ import annotations

import numpy as np

from .request import MAX_CONTROL_PIXELS, ControlInput, ParamError


def control_map(control: ControlInput) -> np.ndarray:
    """The control map of a control: its image, or the image through its preprocessor."""
    image = control.image
    if control.preprocess == "invert":
        return 255 - image
    if control.preprocess == "canny":
        try:
            import cv2
        except ImportError:
            raise ParamError("controls", "preprocess 'canny' needs OpenCV on the server: pip install "
                                         "opencv-python-headless (or send the edge map with preprocess 'none')") from None
        edges = cv2.Canny(image, control.canny_low, control.canny_high)
        return np.repeat(edges[:, :, None], 3, axis=2)
    return image


def fit_map(pixels: np.ndarray, width: int, height: int, resize_mode: str = "just_resize") -> np.ndarray:
    """The map [height, width, 3] uint8 under a resize mode (see the module doc)."""
    from PIL import Image
    image = Image.fromarray(pixels)
    if resize_mode == "just_resize":
        return np.asarray(image.resize((width, height), Image.LANCZOS))
    h0, w0 = pixels.shape[:2]
    if resize_mode == "crop_and_resize":  # diffusers' arithmetic: integer sizes, pasted at the centre
        covers = width / height > w0 / h0
        w1 = width if covers else w0 * height // h0
        h1 = height if not covers else h0 * width // w0
        if w1 * h1 > MAX_CONTROL_PIXELS:  # far from the output's aspect: its resized whole would be huge
            raise ParamError("controls", f"control image {w0}x{h0} is too far from the output's aspect ({width}x"
                                         f"{height}) for resize_mode crop_and_resize; crop it nearer that aspect, or "
                                         "use just_resize or resize_and_fill")
        out = Image.new("RGB", (width, height))
        out.paste(image.resize((w1, h1), Image.LANCZOS), box=(width // 2 - w1 // 2, height // 2 - h1 // 2))
        return np.asarray(out)
    if resize_mode != "resize_and_fill":
        raise ValueError(f"resize mode {resize_mode!r} is unknown")
    k = min(width / w0, height / h0)
    w1, h1 = max(1, min(width, round(w0 * k))), max(1, min(height, round(h0 * k)))
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    out = np.empty((height, width, 3), np.uint8)
    out[:] = np.median(border, axis=0).astype(np.uint8)
    top, left = (height - h1) // 2, (width - w1) // 2
    out[top:top + h1, left:left + w1] = np.asarray(image.resize((w1, h1), Image.LANCZOS))
    return out
