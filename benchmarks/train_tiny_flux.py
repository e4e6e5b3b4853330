"""Train hookkit's small Flux-architecture models (and the classifier): the weights in hookkit/tools/trained/.

    python3 benchmarks/train_tiny_flux.py --device cuda --out $OUT     # the shipped tiny run: ~5 min on one H200
    python3 benchmarks/train_tiny_flux.py --quick                      # CPU, a few iterations: end-to-end check
    python3 benchmarks/train_tiny_flux.py --model deep --classifier hookkit/tools/trained/classifier.safetensors \
        --batch 1024 --fit-steps --max-train-seconds 300 --log-every 250 --device cuda --out $OUT
                                                                       # the shipped deep run (16 blocks)

`--model` picks the architecture from `hookkit.tools.trained.MODELS` ("tiny": 2 double + 4 single blocks, 192
hidden; "deep": 4 + 12 blocks, 128 hidden). `--classifier PATH` skips step 1 and judges the samples with that
(shipped) classifier instead, so that both models are measured by the same one.

What it does, in order (all seeded; see hookkit/tools/trained/__init__.py for the model and its conventions):
1. trains `ShapeClassifier` on procedural images (`hookkit.tools.trained.shapes.render`, drawn on the fly) and
   measures it on a held-out set;
2. trains a stock `FluxTransformer2DModel` (the `--model`'s config) with rectified flow
   matching exactly as FluxPipeline samples it: latents = (pixel_unshuffle(image) - shift) * scale, packed
   with `FluxPipeline._pack_latents`; x_t = (1 - sigma) * x0 + sigma * noise; target = noise - x0; the
   transformer gets `timestep = sigma` (the pipeline passes `t / 1000` with t = 1000 * sigma), the class
   embedding as `encoder_hidden_states` / `pooled_projections`, `txt_ids` zeros and `img_ids` from
   `FluxPipeline._prepare_latent_image_ids`. Sigma ~ logit-normal(0, 1) (SD3/Flux) mixed with 20% uniform;
   the class is dropped to the null embedding 10% of the time (so true CFG works). AdamW, warm-up + cosine,
   EMA of the weights (the EMA weights are shipped, stored as float16);
3. reloads the saved file with `hookkit.tools.trained.load_pipeline` and samples it with the stock FluxPipeline at
   28 steps: `samples.png` (rows = classes, columns = seeds 0..7) and the classifier's verdict on 10 classes
   x 20 seeds, including the 20 samples `tests/test_trained.py` checks (seeds 0 and 1 of every class).

Writes to --out (default $OUT, else ./out), a flat folder of 6 files: model.safetensors (~10 MB),
classifier.safetensors (not with --classifier), loss.png, samples.png, MODEL_CARD.md, train_log.json. Copy them
into hookkit/tools/trained/ (the deep model's into hookkit/tools/trained/deep/). CUDA runs train in fp32 with TF32 matmuls (`--precision bf16`: bf16 autocast); CUDA kernels are not bitwise deterministic, so a rerun is
close to, not identical with, the shipped weights. `--max-train-seconds` stops the transformer loop early
(and says so in the log and the model card) should a slow machine run past the 10-minute budget;
`--fit-steps` instead measures the speed over the first steps and shortens the planned steps to what fits in
it, so that the learning rate's cosine ends at the deadline rather than being cut off half way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # runnable from a checkout without installing hookkit
    sys.path.insert(0, str(ROOT))

from hookkit.tools import trained
from hookkit.tools.trained import shapes

SAMPLE_SEEDS = 8  # columns of samples.png
EVAL_SEEDS = 20  # seeds per class for the recognition rate
TEST_SEEDS = (0, 1)  # the 20 samples tests/test_trained.py checks
FIT_AFTER = 200  # --fit-steps: steps timed before the plan is cut to the time left


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(m for m in trained.MODELS if not trained.is_video(m)), default="tiny",
                   help="which architecture (hookkit.tools.trained.MODELS; default tiny; the video model: "
                        "train_tiny_wan.py)")
    p.add_argument("--classifier", default=None, metavar="PATH",
                   help="judge samples with this classifier file (e.g. the shipped one) instead of training one")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when visible)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"), help="output folder (default: $OUT or ./out)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=12000, help="transformer training steps")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=500, help="linear learning-rate warm-up steps")
    p.add_argument("--ema", type=float, default=0.999, help="EMA decay of the shipped weights")
    p.add_argument("--classifier-steps", type=int, default=1500)
    p.add_argument("--max-train-seconds", type=float, default=450.0,
                   help="stop the transformer loop after this long (a guard for the 10-minute budget)")
    p.add_argument("--fit-steps", action="store_true",
                   help=f"after {FIT_AFTER} steps, cut --steps to what fits in --max-train-seconds at the measured "
                        "speed (the cosine schedule then ends at the deadline)")
    p.add_argument("--log-every", type=int, default=500)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="training precision on CUDA: fp32 with TF32 matmuls (default) or bf16 autocast")
    p.add_argument("--quick", action="store_true", help="a few iterations on tiny batches: checks the script end to end")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.classifier_steps, args.warmup, args.log_every = 12, 8, 12, 4, 4
    given = list(sys.argv[1:] if argv is None else argv)  # for the model card's "Reproduce", the folder as OUT
    args.argv = ["OUT" if i and given[i - 1] == "--out" else a.split("=")[0] + "=OUT" if a.startswith("--out=") else a
                 for i, a in enumerate(given)]
    return args


# --- helpers ------------------------------------------------------------------------------------------------


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def autocast(device: torch.device, precision: str = "fp32") -> Any:
    """bf16 autocast on CUDA when asked; fp32 (TF32 matmuls) otherwise. The first H200 run with bf16
    autocast died in backward with CUBLAS_STATUS_EXECUTION_FAILED, so fp32 is the default."""
    if device.type == "cuda" and precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- 1. classifier ------------------------------------------------------------------------------------------


def augment(images: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Pixel noise and occasional blur, so that slightly imperfect generated images are still recognised."""
    b = images.shape[0]
    noise = torch.randn(images.shape, generator=g, device=images.device)
    sigma = torch.rand(b, 1, 1, 1, generator=g, device=images.device) * 0.06
    blurred = F.avg_pool2d(F.pad(images, (1, 1, 1, 1), mode="replicate"), 3, stride=1)
    blur = torch.rand(b, 1, 1, 1, generator=g, device=images.device) < 0.3
    return (torch.where(blur, blurred, images) + sigma * noise).clamp(0, 1)


def train_classifier(args: argparse.Namespace, device: torch.device) -> tuple[trained.ShapeClassifier, dict[str, Any]]:
    torch.manual_seed(args.seed)
    model = trained.ShapeClassifier().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    g = torch.Generator(device).manual_seed(args.seed + 1)
    batch = min(256, args.batch * 4)
    t0 = time.perf_counter()
    for step in range(args.classifier_steps):
        set_lr(opt, lr_at(step, args.classifier_steps, min(100, args.warmup), 2e-3))
        labels = torch.randint(0, trained.NUM_CLASSES, (batch,), generator=g, device=device)
        images = augment(shapes.render(labels, g), g)
        with autocast(device, args.precision):
            loss = F.cross_entropy(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    held_out = torch.Generator(device).manual_seed(args.seed + 1000)
    n = 200 if args.quick else 4000
    labels = torch.arange(n, device=device) % trained.NUM_CLASSES
    with torch.no_grad():
        predicted = torch.cat([model(shapes.render(chunk, held_out)).argmax(-1) for chunk in labels.split(1000)])
    accuracy = (predicted == labels).float().mean().item()
    seconds = time.perf_counter() - t0
    print(f"classifier: {args.classifier_steps} steps, batch {batch}, {seconds:.1f} s; "
          f"held-out accuracy on {n} procedural images: {accuracy:.4f}", flush=True)
    return model.cpu(), dict(steps=args.classifier_steps, batch=batch, seconds=seconds, held_out_images=n,
                             held_out_accuracy=accuracy, params=sum(p.numel() for p in model.parameters()))


# --- 2. transformer -----------------------------------------------------------------------------------------


def fit(args: argparse.Namespace, device: torch.device, model: torch.nn.Module,
        loss_of: Callable[[], torch.Tensor], tail: int = 500) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The training loop of the trained-model scripts (this one and train_tiny_wan.py): AdamW (weight decay 0.01 on
    matrices), `lr_at`'s warm-up and cosine, gradient clipping 1.0, an fp32 EMA of the weights (the state returned,
    to ship), `--fit-steps`, `--max-train-seconds` and a log line every `--log-every` steps. `loss_of()` draws the
    next batch and returns its loss; `tail` steps give the final loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    ema = [p.detach().clone().float() for p in params]
    decay_groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
                    {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(decay_groups, lr=args.lr, betas=(0.9, 0.99), fused=device.type == "cuda")
    losses = torch.zeros(args.steps, device=device)
    t0 = time.perf_counter()
    done, stopped_early, total = 0, False, args.steps
    for step in range(args.steps):
        if step >= total:
            break
        if args.fit_steps and step == FIT_AFTER and total > FIT_AFTER:
            sync(device)
            per_step = (time.perf_counter() - t0) / FIT_AFTER
            total = max(FIT_AFTER + 1, min(args.steps, int(args.max_train_seconds / per_step * 0.97)))
            print(f"  --fit-steps: {per_step * 1e3:.1f} ms a step over the first {FIT_AFTER}: planning {total} steps "
                  f"(of {args.steps}) for {args.max_train_seconds:g} s", flush=True)
        set_lr(opt, lr_at(step, total, args.warmup, args.lr))
        loss = loss_of()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            decay = min(args.ema, (1 + step) / (10 + step))
            torch._foreach_lerp_(ema, [p.detach().float() for p in params], 1 - decay)
            losses[step] = loss.detach()
        done = step + 1
        if done % args.log_every == 0 or done == total:
            sync(device)
            elapsed = time.perf_counter() - t0
            recent = losses[max(0, done - args.log_every):done].mean().item()
            print(f"  step {done:6d}/{total}  loss {recent:.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"{elapsed:6.1f} s  ({done / elapsed:.1f} steps/s)", flush=True)
            if elapsed > args.max_train_seconds and done < total:
                print(f"  stopping early after {done} steps: --max-train-seconds {args.max_train_seconds:g} reached",
                      flush=True)
                stopped_early = True
                break
    sync(device)
    seconds = time.perf_counter() - t0
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    state = {n: e.cpu() for n, e in zip(names, ema)}
    curve = losses[:done].cpu().tolist()
    last = min(len(curve), tail)
    return state, dict(steps=done, planned_steps=total, requested_steps=args.steps, fit_steps=args.fit_steps,
                       stopped_early=stopped_early, batch=args.batch, lr=args.lr,
                       warmup=args.warmup, ema=args.ema, seconds=seconds, steps_per_second=done / seconds,
                       final_loss=sum(curve[-last:]) / last, params=sum(p.numel() for p in params), losses=curve)


def flow_matching_batch(x0: torch.Tensor, labels: torch.Tensor,
                        g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_t, sigma, target, classes) of a rectified-flow batch from clean latents `x0` (batch first): sigma
    logit-normal(0, 1) mixed with 20% uniform, x_t = (1 - sigma) x0 + sigma noise, target noise - x0, the class dropped
    to the null class 10% of the time. Drawn from `g` in this order, so a run is a function of its seed."""
    b = x0.shape[0]
    noise = torch.randn(x0.shape, generator=g, device=x0.device)
    logit_normal = torch.sigmoid(torch.randn(b, generator=g, device=x0.device))
    uniform = torch.rand(b, generator=g, device=x0.device)
    sigma = torch.where(torch.rand(b, generator=g, device=x0.device) < 0.2, uniform, logit_normal)
    s = sigma.view(b, *[1] * (x0.ndim - 1))
    drop = torch.rand(b, generator=g, device=x0.device) < 0.1
    cls = torch.where(drop, torch.full_like(labels, trained.NULL_CLASS), labels)
    return (1 - s) * x0 + s * noise, sigma, noise - x0, cls


def list_written(out: Path, seconds: float) -> None:
    """The closing lines of a training script: its total time and the files it wrote, with their sizes."""
    print(f"total {seconds:.1f} s; wrote:")
    for f in sorted(out.iterdir()):
        print(f"  {f.name:24s} {f.stat().st_size / 1e6:7.2f} MB")


def train_transformer(args: argparse.Namespace, device: torch.device,
                      conditions: trained.ClassConditions) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from diffusers import FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(args.seed)
    config = trained.MODELS[args.model][0]
    model = FluxTransformer2DModel(**config).to(device).train()
    vae = trained.PatchVAE().to(device)
    embeds = conditions.prompt_embeds.to(device)
    pooled = conditions.pooled_prompt_embeds.to(device)
    side = trained.IMAGE_SIZE // trained.PATCH  # latent height and width (16)
    img_ids = FluxPipeline._prepare_latent_image_ids(1, side // 2, side // 2, device, torch.float32)
    txt_ids = torch.zeros(trained.TEXT_TOKENS, 3, device=device)
    g = torch.Generator(device).manual_seed(args.seed + 2)
    b = args.batch
    print(f"transformer ({args.model}: {config['num_layers']} double + {config['num_single_layers']} single blocks, "
          f"{config['num_attention_heads'] * config['attention_head_dim']} hidden): "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {args.steps} steps of batch {b}, "
          f"{(side // 2) ** 2} image tokens + {trained.TEXT_TOKENS} text tokens", flush=True)

    def loss_of() -> torch.Tensor:
        labels = torch.randint(0, trained.NUM_CLASSES, (b,), generator=g, device=device)
        with torch.no_grad():
            images = shapes.render(labels, g) * 2 - 1
            x0 = (vae.encode(images) - vae.config.shift_factor) * vae.config.scaling_factor
            x0 = FluxPipeline._pack_latents(x0, b, trained.LATENT_CHANNELS, side, side)
            x_t, sigma, target, cls = flow_matching_batch(x0, labels, g)
        with autocast(device, args.precision):
            pred = model(hidden_states=x_t, timestep=sigma, guidance=None, pooled_projections=pooled[cls],
                         encoder_hidden_states=embeds[cls], txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        return F.mse_loss(pred.float(), target)

    return fit(args, device, model, loss_of)


# --- 3. save, sample, evaluate ---------------------------------------------------------------------------------


@torch.no_grad()
def generate(pipe: Any, weights: Path, labels: list[int], seeds: list[int], device: torch.device,
             chunk: int = 100) -> torch.Tensor:
    """Images (N, 3, 32, 32) in [0, 1] on the CPU, from the stock FluxPipeline at 28 steps."""
    out = []
    for i in range(0, len(labels), chunk):
        kwargs = trained.call_kwargs(labels[i:i + chunk], seeds[i:i + chunk], steps=28, device=device,
                                     dtype=torch.float32, path=weights)
        out.append(pipe(**kwargs).images.float().cpu())
    return torch.cat(out)


def save_grid(images: torch.Tensor, rows: int, cols: int, path: Path, scale: int = 3) -> None:
    """A labelled grid: one row per class (its name on the left), one column per seed."""
    from PIL import Image, ImageDraw

    size = images.shape[-1] * scale
    left, top, gap = 120, 18, 2
    canvas = Image.new("RGB", (left + cols * (size + gap), top + rows * (size + gap)), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for c in range(cols):
        draw.text((left + c * (size + gap) + size // 2 - 12, 3), f"seed {c}", fill=(0, 0, 0))
    for r in range(rows):
        draw.text((4, top + r * (size + gap) + size // 2 - 6), trained.CLASSES[r], fill=(0, 0, 0))
        for c in range(cols):
            img = images[r * cols + c]
            img = F.interpolate(img[None], scale_factor=scale, mode="nearest")[0]
            arr = (img.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
            canvas.paste(Image.fromarray(arr), (left + c * (size + gap), top + r * (size + gap)))
    canvas.save(path)


def save_loss_plot(losses: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(1, min(100, len(losses) // 20))
    smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
              for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(losses, color="tab:blue", alpha=0.25, linewidth=0.5, label="per step")
    ax.plot(smooth, color="tab:blue", label=f"moving mean ({window} steps)")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("flow-matching MSE")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def evaluate(pipe: Any, weights: Path, classifier: trained.ShapeClassifier, device: torch.device,
             seeds: int) -> dict[str, Any]:
    labels = [c for c in range(trained.NUM_CLASSES) for _ in range(seeds)]
    seed_list = [s for _ in range(trained.NUM_CLASSES) for s in range(seeds)]
    images = generate(pipe, weights, labels, seed_list, device)
    with torch.no_grad():
        predicted = classifier(images).argmax(-1).tolist()
    hits = [p == l for p, l in zip(predicted, labels)]
    per_class = {trained.CLASSES[c]: sum(hits[c * seeds:(c + 1) * seeds]) / seeds for c in range(trained.NUM_CLASSES)}
    test_hits = [h for h, s in zip(hits, seed_list) if s in TEST_SEEDS]
    return dict(samples=len(labels), seeds_per_class=seeds, accuracy=sum(hits) / len(hits), per_class=per_class,
                test_samples=len(test_hits), test_accuracy=sum(test_hits) / max(1, len(test_hits)))


# --- model card -----------------------------------------------------------------------------------------------


def model_card(log: dict[str, Any]) -> str:
    t, c, e = log["transformer"], log["classifier"], log["evaluation"]
    name = log.get("model", "tiny")
    cfg = trained.MODELS[name][0]
    blocks = cfg["num_layers"] + cfg["num_single_layers"]
    early = (f" **Stopped early** at {t['steps']} of {t['planned_steps']} planned steps (time guard)."
             if t["stopped_early"] else "")
    fitted = (f" `--fit-steps`: {t['planned_steps']} of the {t['requested_steps']} requested steps were planned from "
              f"the speed of the first {FIT_AFTER}, so the cosine schedule ends at the time limit."
              if t.get("fit_steps") else "")
    loader = "load_pipeline()" if name == "tiny" else f'load_pipeline(model="{name}")'
    folder = "hookkit/tools/trained/" if name == "tiny" else f"hookkit/tools/trained/{name}/"
    why = ("" if name == "tiny" else
           f"\nThe second shipped model: with {blocks} blocks, one block is at most 1/{blocks} of a step, so the first\n"
           f"block that block-level caching always computes no longer costs 1/6 of a step as in the tiny model\n"
           f"(a real Flux has 57 blocks). Same data, classes, latents, conditioning and classifier as the tiny one.\n")
    if c.get("trained", True):
        classifier_text = (f"`ShapeClassifier` ({c['params'] / 1e3:.0f} k parameters: five 3x3 convolutions, mean+max "
                           f"pooling, linear), trained\n{c['steps']} steps of batch {c['batch']} on procedural images "
                           f"with noise/blur augmentation; accuracy on\n{c['held_out_images']} held-out procedural "
                           f"images: {c['held_out_accuracy']:.2%}.")
    else:
        classifier_text = (f"The shipped `ShapeClassifier` (`{c['path']}`, trained with the tiny model; not retrained "
                           f"here), so that both models are judged by the same one.")
    per_class = "\n".join(f"| {name} | {acc:.0%} |" for name, acc in e["per_class"].items())
    hidden = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    quick = "\n**QUICK RUN (--quick): a check of the script, not a trained model. Do not ship.**\n" if log["quick"] else ""
    return f"""# hookkit {name} Flux (trained)
{quick}
A small model with the real Flux classes, trained so that hookkit's caching is judged on real denoising
trajectories (random weights never cache dynamically). Made by `benchmarks/train_tiny_flux.py`; loaded by
`hookkit.tools.trained.{loader}` into a stock `diffusers.FluxPipeline` (no text encoders).
{why}
## Model
- `FluxTransformer2DModel`: {cfg['num_layers']} double-stream + {cfg['num_single_layers']} single-stream blocks,
  {cfg['num_attention_heads']} heads x {cfg['attention_head_dim']} = {hidden} hidden, `joint_attention_dim`
  {cfg['joint_attention_dim']}, `pooled_projection_dim` {cfg['pooled_projection_dim']}, no guidance embedding,
  RoPE axes {tuple(cfg['axes_dims_rope'])}; {t['params'] / 1e6:.2f} M parameters, shipped as float16 (EMA weights).
- Conditioning: each class is a fixed random `prompt_embeds` (1, {trained.TEXT_TOKENS}, {cfg['joint_attention_dim']})
  and `pooled_prompt_embeds` (1, {cfg['pooled_projection_dim']}) (seed {log['seed']}), stored in `model.safetensors`;
  one extra null class (index {trained.NULL_CLASS}) for true CFG.
- Latents: no trained autoencoder. `PatchVAE` pixel-unshuffles a 32x32 RGB image in [-1, 1] by 2 into
  12x16x16, normalised with shift {trained.SHIFT_FACTOR} and scale {trained.SCALING_FACTOR}; FluxPipeline packs
  2x2 latent patches, so the transformer sees 64 image tokens of 48 channels (a 4x4 pixel patch each).
- Scheduler: `FlowMatchEulerDiscreteScheduler` with Flux-dev's dynamic shift; 28 steps by default.

## Data
Procedural 32x32 images drawn on the fly (`hookkit/tools/trained/shapes.py`): one shape on a dark, tinted,
gradient background; random position, size, rotation and brightness; one-pixel anti-aliasing.
Classes (shape x colour; every shape and several colours occur in two classes):
{', '.join(f'{i} {n}' for i, n in enumerate(trained.CLASSES))}.

## Training
Rectified flow matching as FluxPipeline samples it: x_t = (1 - sigma) x0 + sigma noise, target noise - x0,
`timestep` = sigma; sigma logit-normal(0, 1) with 20% uniform; class dropped to null 10% of the time.
{t['steps']} steps of batch {t['batch']}, AdamW (lr {t['lr']:g}, betas (0.9, 0.99), weight decay 0.01 on
matrices), {t['warmup']} warm-up steps then cosine to 10%, gradient clipping 1.0, EMA {t['ema']}, precision
{log.get('precision', 'fp32')} on CUDA. {t['seconds']:.0f} s on {log['device']} ({t['steps_per_second']:.1f} steps/s); final loss (mean of the
last 500 steps) {t['final_loss']:.4f}.{early}{fitted}

![training loss](loss.png)

## Samples
Stock FluxPipeline, 28 steps, no CFG; rows are classes, columns seeds 0..{log['sample_seeds'] - 1}.

![samples](samples.png)

## Classifier
{classifier_text}

Generated samples it recognises as the class asked for (28 steps, no CFG, {e['seeds_per_class']} seeds per class):
**{e['accuracy']:.1%}** of {e['samples']}; on the {e['test_samples']} samples `tests/test_trained.py` checks
(seeds {', '.join(map(str, TEST_SEEDS))} of every class): {e['test_accuracy']:.0%}.

| class | recognised |
|---|---|
{per_class}

## Reproduce
`python3 benchmarks/train_tiny_flux.py {' '.join(log.get('argv') or ['--device', 'cuda', '--out', 'OUT'])}` (seed {log['seed']}; torch {log['torch']},
diffusers {log['diffusers']}); copy the files into `{folder}`. CUDA kernels are not bitwise deterministic: a
rerun is close, not identical.

## Limits
A toy: 32x32, ten classes, 64 image tokens, {blocks} blocks. It shows how caching behaves on a trained
rectified-flow trajectory; speed-ups in wall time on it are dominated by per-call overheads.
"""


# --- main -------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import diffusers

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"train_tiny_flux: {name}, torch {torch.__version__}, diffusers {diffusers.__version__}, seed {args.seed}"
          f"{', QUICK (not for shipping)' if args.quick else ''}", flush=True)

    if args.classifier is None:
        classifier, classifier_log = train_classifier(args, device)
    else:  # the shipped classifier: every model is judged by the same one
        classifier = trained.load_classifier(path=args.classifier)
        classifier_log = dict(trained=False, path=str(args.classifier),
                              params=sum(p.numel() for p in classifier.parameters()))
        print(f"classifier: {args.classifier} (not retrained)", flush=True)
    conditions = trained.make_conditions(args.seed)
    state, transformer_log = train_transformer(args, device, conditions)

    meta = dict(config=trained.MODELS[args.model][0], model=args.model, seed=args.seed, quick=args.quick,
                steps=transformer_log["steps"], batch=args.batch, torch=torch.__version__,
                diffusers=diffusers.__version__, device=name)
    model_path = out / "model.safetensors"
    trained.save_model(model_path, state, conditions, meta)
    if args.classifier is None:
        trained.save_classifier(out / "classifier.safetensors", classifier)

    # Sample the saved file through the public loader: what ships is what is measured.
    pipe = trained.load_pipeline(device=device, dtype=torch.float32, path=model_path)
    t0 = time.perf_counter()
    cols = 2 if args.quick else SAMPLE_SEEDS
    grid = generate(pipe, model_path, [c for c in range(trained.NUM_CLASSES) for _ in range(cols)],
                    [s for _ in range(trained.NUM_CLASSES) for s in range(cols)], device)
    save_grid(grid, trained.NUM_CLASSES, cols, out / "samples.png")
    evaluation = evaluate(pipe, model_path, classifier, device, 2 if args.quick else EVAL_SEEDS)
    evaluation["seconds"] = time.perf_counter() - t0
    save_loss_plot(transformer_log["losses"], out / "loss.png", f"hookkit {args.model} Flux: training loss")

    log = dict(model=args.model, argv=args.argv, seed=args.seed, quick=args.quick, precision=args.precision, sample_seeds=cols, device=name, torch=torch.__version__, diffusers=diffusers.__version__,
               python=platform.python_version(), classifier=classifier_log, transformer=transformer_log,
               evaluation=evaluation, total_seconds=time.perf_counter() - start)
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    (out / "MODEL_CARD.md").write_text(model_card(log))

    print(f"generated samples recognised by the classifier: {evaluation['accuracy']:.1%} of {evaluation['samples']}; "
          f"test set (seeds {TEST_SEEDS}): {evaluation['test_accuracy']:.0%} of {evaluation['test_samples']}")
    for cls, acc in evaluation["per_class"].items():
        print(f"  {cls:16s} {acc:.0%}")
    list_written(out, log["total_seconds"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
