"""Graph configuration: `GraphConfig` (which CUDA graphs exist: batch buckets, resolutions, prewarm
list, verification) and the parsers for its command-line / TOML forms. The scheduler's and the server's
configurations live beside the code that reads them (engine/scheduler.py, server/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BUCKETS = (1, 2, 4, 8, 16)


def smallest_bucket(buckets: tuple[int, ...], n: int) -> int | None:
    """The smallest of the (increasing) buckets that holds n rows, or None when n exceeds the largest."""
    return next((b for b in buckets if b >= n), None)


def parse_buckets(text: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4): positive, unique, sorted."""
    items = text.split(",") if isinstance(text, str) else list(text)
    try:
        values = sorted({int(v) for v in items if str(v).strip()})
    except ValueError:
        raise ValueError(f"batch buckets {text!r} must be comma-separated positive integers, e.g. 1,2,4,8,16") from None
    if not values or values[0] < 1:
        raise ValueError(f"batch buckets {text!r} must be positive integers, e.g. 1,2,4,8,16")
    return tuple(values)


def parse_prewarm(text: str) -> bool | tuple[tuple[int, int, int], ...]:
    """'all' | 'none' | 'WxH[@b1/b2...],...' -> GraphConfig.prewarm ('512x512@1/2/4' = those buckets; no @ = all
    buckets, returned with bucket 0 meaning "every bucket")."""
    text = text.strip().lower()
    if text in ("all", "true", ""):
        return True
    if text in ("none", "false"):
        return False
    keys = []
    for item in text.split(","):
        res, _, buckets = item.partition("@")
        (h, w), = parse_resolutions(res)
        for b in (buckets.split("/") if buckets else ["0"]):
            try:
                keys.append((h, w, int(b)))
            except ValueError:
                raise ValueError(f"prewarm item {item!r} must look like WxH or WxH@1/2/4") from None
    return tuple(keys)


def parse_resolutions(text: str | list) -> tuple[tuple[int, int], ...]:
    """'512x512,768x512' (WxH) -> ((512, 512), (512, 768)) as (height, width) pairs."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        if isinstance(item, tuple):
            out.append((int(item[0]), int(item[1])))
            continue
        item = str(item).strip().lower()
        if not item:
            continue
        try:
            w, h = (int(v) for v in item.split("x"))
        except ValueError:
            raise ValueError(f"resolution {item!r} must look like WIDTHxHEIGHT, e.g. 512x512") from None
        if w % 8 or h % 8 or w <= 0 or h <= 0:
            raise ValueError(f"resolution {item!r}: width and height must be positive multiples of 8")
        out.append((h, w))
    return tuple(out)


@dataclass(frozen=True)
class GraphConfig:
    """Which CUDA graphs exist. resolutions are (height, width); empty means the model's native size."""

    batch_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    resolutions: tuple[tuple[int, int], ...] = ()
    # start-up captures: True = every (resolution, bucket); False = none; or (height, width, bucket) keys.
    # Keys not prewarmed are captured on first use.
    prewarm: bool | tuple[tuple[int, int, int], ...] = True
    capture_text_encoder: bool = True
    capture_vae: bool = True
    verify: bool = False            # replay vs eager max abs difference at capture, kept in the table
    warmup_iters: int = 3
    backend: str = "cuda"           # "emulated": replays re-run the function eagerly (CPU tests of the runner)

    @property
    def max_bucket(self) -> int:
        return max(self.batch_buckets)

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket >= n, or None when n exceeds the largest."""
        return smallest_bucket(self.batch_buckets, n)
