"""`hookkit demo`: the shipped trained tiny Flux, plain vs hookkit, side by side in one labelled PNG.

Random weights never cache dynamically and draw noise; the trained tiny Flux (`hookkit.tools.trained`) draws
recognisable shapes, and `hookkit.DBCache()` (the measured default) caches about half of its 28 steps with
images identical to the eye. So the demo shows what a user would get: one stock `FluxPipeline` call per
class, plain and with hookkit, each panel labelled with its class, time, cached steps and PSNR against plain,
then the summary and a check that the pipeline after `hookkit.disable` is bitwise the plain one again.

    python -m hookkit demo [--classes "red circle,green square"] [--out hookkit-demo.png] [--model deep]

`--model deep` draws with the 16-block trained model instead of the 6-block tiny one (`trained.MODELS`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

import hookkit
from hookkit.errors import SpecError

#: classes drawn by default: four shapes in four colours
DEFAULT_CLASSES: tuple[str, ...] = ("red circle", "green square", "blue triangle", "yellow cross")
#: pixels per image pixel in the grid (the model draws 32x32)
SCALE = 4
#: the PNG text chunk holding the panels' labels as JSON (so tests and tools read what the picture says)
PANELS_KEY = "hookkit:panels"


@attrs.frozen(kw_only=True)
class Panel:
    """One image of the grid and what its label says.

    Args:
        row: "plain" or "hookkit".
        label: the class drawn (the "prompt" of the class-conditioned model).
        seconds: wall time of the pipeline call that made it.
        cached: transformer steps served from the cache (0 for plain).
        steps: transformer steps of the call.
        psnr: dB against the plain image of the same class (None for plain itself; inf when equal).
    """

    row: str
    label: str
    seconds: float
    cached: int
    steps: int
    psnr: float | None

    def caption(self) -> list[str]:
        lines = [f"{self.seconds:.2f} s", f"cached {self.cached}/{self.steps}"]
        if self.psnr is not None:
            lines.append("bitwise equal" if self.psnr == float("inf") else f"PSNR {self.psnr:.1f} dB")
        return lines


def demo_spec() -> hookkit.Spec:
    """What the demo turns on: `DBCache()` as it comes (the measured default) plus the CPU-safe sync-free loop.

    Compile and quantization are left out: minutes of CPU compilation, and schemes that need a GPU.
    """
    return hookkit.Spec(cache=hookkit.DBCache(), sync_free=True)


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: one bitmap size only
        return ImageFont.load_default()


def save_grid(plain: Sequence[torch.Tensor], hooked: Sequence[torch.Tensor], panels: Sequence[Panel],
              title: str, path: Path) -> Path:
    """Write the 2-row grid (plain above, hookkit below; one column per class) with labels as a PNG.

    Each image is (3, H, W) in [0, 1], scaled up `SCALE` times with nearest neighbours so pixels stay pixels.
    The labels are drawn and also stored as JSON in the PNG text chunk `PANELS_KEY`.
    """
    from PIL import Image, ImageDraw
    from PIL.PngImagePlugin import PngInfo

    cols = len(plain)
    h, w = plain[0].shape[-2] * SCALE, plain[0].shape[-1] * SCALE
    left, top, pad, caption_h = 150, 56, 12, 58
    width = left + cols * (w + pad) + pad
    height = top + 2 * (h + caption_h + pad)
    canvas = Image.new("RGB", (width, height), (24, 24, 28))
    draw = ImageDraw.Draw(canvas)
    big, small = _font(16), _font(13)
    draw.text((pad, pad), title, fill=(240, 240, 240), font=big)
    row_names = {"plain": "plain diffusers", "hookkit": "hookkit\nDBCache()"}
    for r, (row, images) in enumerate((("plain", plain), ("hookkit", hooked))):
        y = top + r * (h + caption_h + pad)
        draw.multiline_text((pad, y + h // 2 - 16), row_names[row], fill=(240, 240, 240), font=big)
        for c, image in enumerate(images):
            x = left + c * (w + pad)
            if r == 0:
                draw.text((x, top - 22), panels[c].label, fill=(240, 240, 240), font=small)
            pixels = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
            canvas.paste(Image.fromarray(pixels).resize((w, h), Image.NEAREST), (x, y))
            panel = panels[r * cols + c]
            draw.multiline_text((x, y + h + 4), "\n".join(panel.caption()), fill=(200, 200, 200), font=small)
    info = PngInfo()
    info.add_text(PANELS_KEY, json.dumps([attrs.asdict(p) for p in panels]))
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path, pnginfo=info)
    return path


def read_panels(path: str | Path) -> list[dict[str, Any]]:
    """The panel labels stored in a demo PNG (`save_grid`)."""
    from PIL import Image

    with Image.open(path) as image:
        return json.loads(image.text[PANELS_KEY])


def run_demo(classes: Sequence[str], steps: int, seed: int, out: Path, threads: int, model: str = "tiny") -> int:
    """Run the demo, print what it did, write the grid; the exit code is 0 iff disable restored plain exactly.

    Args:
        model: which shipped trained model draws: "tiny" (2 + 4 blocks) or "deep" (4 + 12 blocks).
    """
    from hookkit.tools import bench, trained
    from hookkit.core.summary import table

    torch.set_num_threads(threads)
    device = torch.device("cpu")
    image_models = [m for m in trained.MODELS if m not in trained.VIDEO_MODELS]
    if model not in image_models:  # before any model is loaded
        clips = (", which makes clips; judge caching on it with `python -m hookkit.tools.front --model video`"
                 if model in trained.VIDEO_MODELS else "")
        raise SpecError(f"hookkit demo --model: expected an image model ({' or '.join(image_models)}), got "
                        f"{model!r}{clips}.")
    for name in classes:
        trained.class_index(name)
    pipe = trained.load_pipeline(model=model)
    spec = demo_spec()
    print(f"hookkit demo: hookkit's trained {model} Flux (stock FluxPipeline, {steps} steps, 32x32, "
          f"{bench.device_description(device)}), one call per class, seeds {seed}..{seed + len(classes) - 1}")
    from hookkit.techniques.cache.spec import effective_warmup_steps

    cache = spec.cache
    assert cache is not None  # demo_spec's, not user input
    if cache.rule == "threshold":
        how = f"threshold {cache.threshold}, warm-up {effective_warmup_steps(cache, steps)} of {steps} steps"
    else:
        how = f"{cache.rule} rule, {cache.speedup:g}x less block work over {steps} steps"
    print(f"hookkit turns on: hookkit.Spec(cache=hookkit.DBCache(), sync_free=True): {how}, "
          f"TaylorSeer order {cache.taylorseer_order}")

    def call(i: int) -> tuple[float, torch.Tensor]:
        kwargs = trained.call_kwargs([classes[i]], seeds=[seed + i], steps=steps, model=model)  # fresh generators
        start = time.perf_counter()
        images = pipe(**kwargs).images
        return time.perf_counter() - start, images[0]

    call(0)  # one untimed call: lazy initialisation and first-call allocations would be charged to "plain"
    plain = [call(i) for i in range(len(classes))]
    handle = hookkit.enable(pipe, spec)
    hooked, cached = [], []
    for i in range(len(classes)):
        hooked.append(call(i))
        data = handle.summary().features["cache"].data
        cached.append(sum(len(b["cached"]) for b in data["branches"].values()))
    summary = handle.summary()
    hookkit.disable(pipe)
    after = [call(i)[1] for i in range(len(classes))]

    panels = [Panel(row="plain", label=name, seconds=t, cached=0, steps=steps, psnr=None)
              for name, (t, _) in zip(classes, plain)]
    panels += [Panel(row="hookkit", label=name, seconds=t, cached=n, steps=steps,
                     psnr=bench.psnr(p, image, peak=1.0))
               for name, (t, image), n, (_, p) in zip(classes, hooked, cached, plain)]
    t_plain, t_hooked = sum(t for t, _ in plain), sum(t for t, _ in hooked)
    title = (f"trained {model} Flux, {steps} steps, CPU: plain {t_plain:.2f} s, hookkit DBCache() {t_hooked:.2f} s "
             f"({t_plain / t_hooked:.2f}x)")
    path = save_grid([p for _, p in plain], [h for _, h in hooked], panels, title, out)

    print()
    print(summary.render(full=False))  # fits 100 columns; str(summary) has every detail
    print()
    print(table(["class", "plain (s)", "hookkit (s)", "cached steps", "PSNR vs plain"],
                [[p.label, f"{p.seconds:.3f}", f"{h.seconds:.3f}", f"{h.cached} of {steps}",
                  "inf" if h.psnr == float("inf") else f"{h.psnr:.1f} dB"]
                 for p, h in zip(panels[:len(classes)], panels[len(classes):])]))
    print(f"total: plain {t_plain:.2f} s, hookkit {t_hooked:.2f} s ({t_plain / t_hooked:.2f}x)")
    equal = all(torch.equal(a, p) for a, (_, p) in zip(after, plain))
    print(f"after hookkit.disable: output bitwise equal to the plain run: {equal}")
    print(f"Saved the side-by-side grid: {path.resolve()}")
    return 0 if equal else 1
