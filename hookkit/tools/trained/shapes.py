"""Procedural, class-conditioned training images: one coloured shape on a shaded background.

Every image is drawn on the fly from a handful of random numbers (position, size, rotation, brightness,
background), vectorised over the batch on whatever device the labels live on, so training needs no data
set on disk and never sees the same image twice. Classes pair a shape with a colour; shapes and colours
each occur in more than one class, so that recognising a class needs both.

Shapes are signed distance functions evaluated on the pixel grid (coordinates in [-1, 1]) and
anti-aliased over one pixel, so that edges are smooth rather than jagged.
"""

from __future__ import annotations

import functools
import math

import torch

#: (name, shape, RGB colour in [0, 1]) of each class, in label order.
CLASS_SPECS: tuple[tuple[str, str, tuple[float, float, float]], ...] = (
    ("red circle", "circle", (0.90, 0.15, 0.15)),
    ("green square", "square", (0.15, 0.75, 0.20)),
    ("blue triangle", "triangle", (0.20, 0.35, 0.95)),
    ("yellow cross", "cross", (0.95, 0.85, 0.15)),
    ("magenta ring", "ring", (0.85, 0.20, 0.85)),
    ("cyan circle", "circle", (0.15, 0.80, 0.85)),
    ("orange square", "square", (1.00, 0.55, 0.10)),
    ("yellow triangle", "triangle", (0.95, 0.85, 0.15)),
    ("white cross", "cross", (0.92, 0.92, 0.92)),
    ("blue ring", "ring", (0.20, 0.35, 0.95)),
)
CLASSES: tuple[str, ...] = tuple(name for name, _, _ in CLASS_SPECS)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross", "ring")


def _sdf(shape: str, px: torch.Tensor, py: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Signed distance (negative inside) of `shape` with circumradius-like size `r` at the local point (px, py)."""
    if shape == "circle":
        return torch.sqrt(px * px + py * py) - r
    if shape == "square":
        return torch.maximum(px.abs(), py.abs()) - 0.8 * r
    if shape == "triangle":  # equilateral, circumradius r: the max over its three edge half-planes
        d = None
        for angle in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6):
            e = px * math.cos(angle) + py * math.sin(angle)
            d = e if d is None else torch.maximum(d, e)
        return d - 0.5 * r
    if shape == "cross":
        arm, half = 0.9 * r, 0.3 * r
        horizontal = torch.maximum(px.abs() - arm, py.abs() - half)
        vertical = torch.maximum(px.abs() - half, py.abs() - arm)
        return torch.minimum(horizontal, vertical)
    if shape == "ring":
        thickness = 0.38 * r
        return (torch.sqrt(px * px + py * py) - (r - thickness / 2)).abs() - thickness / 2
    raise ValueError(f"shapes._sdf.shape: expected one of {SHAPES}, got {shape!r}.")


@functools.lru_cache(maxsize=8)
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(shape index per class, RGB per class) on `device`, made once: a host-to-device copy per batch would
    synchronise the training loop with the GPU."""
    shape_of_class = torch.tensor([SHAPES.index(shape) for _, shape, _ in CLASS_SPECS], device=device)
    palette = torch.tensor([rgb for _, _, rgb in CLASS_SPECS], device=device)
    return shape_of_class, palette


def render(labels: torch.Tensor, generator: torch.Generator, size: int = 32, frames: int = 1) -> torch.Tensor:
    """Images (B, 3, size, size) in [0, 1] of the classes `labels` (B,), drawn with `generator`; with `frames` > 1,
    clips (B, frames, 3, size, size) of the shape moving in a straight line and turning.

    A clip's first frame is drawn from the same numbers as a still (its end position and turn are drawn after
    them), so the classifier trained on stills judges every frame. `generator` must live on `labels.device`; the
    same generator state and labels give the same images.
    """
    if frames < 1:
        raise ValueError(f"shapes.render.frames: expected an int >= 1, got {frames!r}.")
    device = labels.device
    b = labels.shape[0]

    def uniform(lo: float, hi: float, *shape: int) -> torch.Tensor:
        return torch.rand(b, *shape, generator=generator, device=device) * (hi - lo) + lo

    coords = (torch.arange(size, device=device, dtype=torch.float32) + 0.5) / size * 2 - 1
    y, x = torch.meshgrid(coords, coords, indexing="ij")  # (size, size)
    x, y = x[None], y[None]

    # Background: a dark tinted grey with a linear gradient in a random direction.
    base = uniform(0.05, 0.30, 1, 1, 1) + uniform(-0.05, 0.05, 3, 1, 1)
    phi = uniform(0.0, 2 * math.pi, 1, 1)
    amp = uniform(0.0, 0.15, 1, 1)
    gradient = amp * (torch.cos(phi) * x + torch.sin(phi) * y) / 2  # (B, size, size)
    background = base + gradient[:, None]

    # Shape: position, size, rotation (then the colour's brightness; a clip's end position and turn last).
    cx, cy = uniform(-0.4, 0.4, 1, 1), uniform(-0.4, 0.4, 1, 1)
    r = uniform(0.38, 0.62, 1, 1)
    theta = uniform(0.0, 2 * math.pi, 1, 1)
    colour_gain = uniform(0.8, 1.05, 1, 1, 1)
    if frames > 1:
        end_x, end_y = uniform(-0.4, 0.4, 1, 1), uniform(-0.4, 0.4, 1, 1)
        turn = uniform(-math.pi / 2, math.pi / 2, 1, 1)

    shape_of_class, palette = _tables(device)
    shape_of = shape_of_class[labels][:, None, None]
    colour = palette[labels][:, :, None, None] * colour_gain

    def draw(cx: torch.Tensor, cy: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        dx, dy = x - cx, y - cy  # local coordinates rotated by -theta
        c, s = torch.cos(theta), torch.sin(theta)
        px, py = c * dx + s * dy, -s * dx + c * dy
        sdf = torch.zeros(b, size, size, device=device)
        for k, shape in enumerate(SHAPES):
            sdf = torch.where(shape_of == k, _sdf(shape, px, py, r), sdf)
        alpha = (0.5 - sdf / (2.0 / size)).clamp(0.0, 1.0)[:, None]  # one-pixel anti-aliasing
        shading = 0.9 + 0.1 * (px / r).clamp(-1.0, 1.0)  # a soft light from one side, turning with the shape
        fill = colour * shading[:, None]
        return (background * (1 - alpha) + fill * alpha).clamp(0.0, 1.0)

    if frames == 1:
        return draw(cx, cy, theta)
    clip = []
    for f in range(frames):
        w = f / (frames - 1)
        clip.append(draw(cx + (end_x - cx) * w, cy + (end_y - cy) * w, theta + turn * w))
    return torch.stack(clip, dim=1)
