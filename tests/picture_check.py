"""What a test asks of a rendered picture beyond the PNG header: that it decodes (matplotlib reads it back),
has the size of a figure, and shows something: a share of its pixels differs from the background, in
several colours (a blank or one-colour canvas, or a truncated file, fails)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np


def assert_real_picture(png: bytes | Path, *, min_width: int = 400, min_height: int = 200,
                        min_drawn: float = 0.01, min_colours: int = 4) -> np.ndarray:
    """Decode `png` (bytes or a path) and check it; returns the pixels [height, width, channels]."""
    import matplotlib.image

    data = png.read_bytes() if isinstance(png, Path) else png
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pixels = matplotlib.image.imread(io.BytesIO(data), format="png")
    height, width = pixels.shape[:2]
    assert width >= min_width and height >= min_height, f"a {width} x {height} picture"
    flat = pixels.reshape(-1, pixels.shape[-1]) if pixels.ndim == 3 else pixels.reshape(-1, 1)
    colours, counts = np.unique(np.round(flat * 255).astype(np.uint8), axis=0, return_counts=True)
    drawn = 1.0 - counts.max() / counts.sum()  # pixels that are not the background colour
    assert drawn >= min_drawn, f"only {drawn:.2%} of the pixels differ from the background"
    assert len(colours) >= min_colours, f"{len(colours)} colours"
    return pixels
