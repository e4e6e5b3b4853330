"""Train hookkit's small trained *video* model (a stock `WanTransformer3DModel`): hookkit/tools/trained/video/.

    python3 benchmarks/train_tiny_wan.py --out $OUT                     # the shipped run: this 2-core CPU, 40 min
    python3 benchmarks/train_tiny_wan.py --device cuda --steps 20000 --batch 256 --out $OUT   # longer, on a GPU
    python3 benchmarks/train_tiny_wan.py --quick                        # a few iterations: end-to-end check

The model and its conventions are `hookkit.tools.trained.video`'s: clips of 9 frames, 32x32, of the image models'
ten classes (`shapes.render(frames=9)`: the shape moves and turns), latents by `PatchVAE3D` (Wan's causal frame
layout: (48, 3, 16, 16), 192 tokens), the image models' class embeddings (`make_conditions(0)`) as
`encoder_hidden_states`. Rectified flow matching as WanPipeline's UniPC (flow_prediction) samples it: x_t = (1 -
sigma) x0 + sigma noise, target noise - x0, `timestep` = 1000 sigma; sigma logit-normal(0, 1) mixed with 20%
uniform; the class dropped to the null embedding 10% of the time (so CFG works). AdamW, warm-up + cosine, EMA of the
weights (shipped as float16). `--max-train-seconds` with `--fit-steps` plans the steps to end at the deadline.

Then it reloads the saved file through `hookkit.tools.trained.load_pipeline(path=..., model="video")`, samples
the stock WanPipeline at 28 steps (4 with --quick) and judges every frame with the shipped classifier (a clip is
recognised when most of its frames are): `samples.png` (rows = classes; each cell the first, middle and last frame),
MODEL_CARD.md, loss.png, train_log.json, model.safetensors in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):  # runnable from a checkout without installing hookkit
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from train_tiny_flux import FIT_AFTER, autocast, fit, flow_matching_batch, list_written, save_loss_plot  # noqa: E402

from hookkit.tools import trained  # noqa: E402
from hookkit.tools.trained import shapes, video  # noqa: E402

MODEL = "video"
SAMPLE_SEEDS = 4  # columns of samples.png
EVAL_SEEDS = 10  # seeds per class for the recognition rate
SAMPLE_STEPS = 28  # denoising steps of the samples and the evaluation (--quick: 4, a check of the script)
TEST_SEEDS = (0, 1)  # the 20 samples tests/test_trained.py checks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--classifier", default=str(trained.CLASSIFIER_FILE), metavar="PATH",
                   help="the classifier that judges the frames (default: the shipped one)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--out", default=os.environ.get("OUT", "out"), help="output folder (default: $OUT or ./out)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default=None, metavar="PATH",
                   help="continue from this video weights file (its EMA weights start the weights and the EMA; its "
                        "class embeddings are kept; give another --seed so that the data differs)")
    p.add_argument("--steps", type=int, default=4000, help="transformer training steps")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=150, help="linear learning-rate warm-up steps")
    p.add_argument("--ema", type=float, default=0.995, help="EMA decay of the shipped weights")
    p.add_argument("--max-train-seconds", type=float, default=2400.0, help="stop the training loop after this long")
    p.add_argument("--fit-steps", action="store_true",
                   help=f"after {FIT_AFTER} steps, cut --steps to what fits in --max-train-seconds at the measured speed")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="on CUDA: fp32 (TF32) or bf16 autocast")
    p.add_argument("--quick", action="store_true", help="a few iterations on tiny batches: checks the script end to end")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.warmup, args.log_every = 6, 4, 2, 3
    given = list(sys.argv[1:] if argv is None else argv)
    args.argv = ["OUT" if i and given[i - 1] == "--out" else a.split("=")[0] + "=OUT" if a.startswith("--out=") else a
                 for i, a in enumerate(given)]
    return args


def latents_of(clips: torch.Tensor, vae: video.PatchVAE3D) -> torch.Tensor:
    """Clips (B, F, 3, H, W) in [0, 1] -> model latents (B, 48, latent frames, H / 2, W / 2), as WanPipeline's
    decode inverts them: (raw - mean) / std."""
    raw = vae.encode(clips.transpose(1, 2) * 2 - 1)
    return (raw - video.LATENT_MEAN) / video.LATENT_STD


def train_transformer(args: argparse.Namespace, device: torch.device,
                      conditions: trained.ClassConditions) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(args.seed)
    config = video.VIDEO_TRANSFORMER_CONFIG
    model = WanTransformer3DModel(**config).to(device).train()
    previous = 0
    if args.init is not None:  # continue a run: its shipped (EMA) weights start both the weights and the EMA
        start = trained.load_transformer(args.init, model=MODEL)
        model.load_state_dict({k: v.float() for k, v in start.state_dict().items()})
        meta = trained.read_metadata(args.init)
        previous = int(meta.get("total_steps", meta["steps"]))
        print(f"continuing from {args.init} ({previous} steps)", flush=True)
    vae = video.PatchVAE3D().to(device)
    embeds = conditions.prompt_embeds.to(device)
    g = torch.Generator(device).manual_seed(args.seed + 2)
    b = args.batch
    tokens = (1 + (video.FRAMES - 1) // video.TEMPORAL) * (trained.IMAGE_SIZE // video.SPATIAL // 2) ** 2
    print(f"transformer (video: {config['num_layers']} Wan blocks, "
          f"{config['num_attention_heads'] * config['attention_head_dim']} hidden): "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {args.steps} steps of batch {b}, "
          f"{video.FRAMES} frames = {tokens} video tokens + {trained.TEXT_TOKENS} text tokens", flush=True)

    def loss_of() -> torch.Tensor:
        labels = torch.randint(0, trained.NUM_CLASSES, (b,), generator=g, device=device)
        with torch.no_grad():
            x0 = latents_of(shapes.render(labels, g, frames=video.FRAMES), vae)
            x_t, sigma, target, cls = flow_matching_batch(x0, labels, g)
        with autocast(device, args.precision):
            pred = model(hidden_states=x_t, timestep=sigma * 1000, encoder_hidden_states=embeds[cls],
                         return_dict=False)[0]
        return F.mse_loss(pred.float(), target)

    state, log = fit(args, device, model, loss_of, tail=200)
    return state, dict(log, previous_steps=previous, init=args.init, tokens=tokens)


@torch.no_grad()
def generate(pipe: Any, weights: Path, labels: list[int], seeds: list[int], device: torch.device, steps: int,
             chunk: int = 50) -> torch.Tensor:
    """Clips (N, FRAMES, 3, 32, 32) in [0, 1] on the CPU, from the stock WanPipeline at `steps` steps, no CFG."""
    out = []
    for i in range(0, len(labels), chunk):
        kwargs = trained.call_kwargs(labels[i:i + chunk], seeds[i:i + chunk], steps=steps, device=device,
                                     dtype=torch.float32, path=weights, model=MODEL)
        out.append(trained.output_images(pipe(**kwargs)).float().cpu())
    return torch.cat(out)


def save_grid(clips: torch.Tensor, rows: int, cols: int, path: Path, scale: int = 3) -> None:
    """One row per class; each seed's cell shows its first, middle and last frame side by side."""
    from PIL import Image, ImageDraw

    size, f = clips.shape[-1] * scale, clips.shape[1]
    picks = (0, f // 2, f - 1)
    cell = len(picks) * size
    left, top, gap = 120, 18, 6
    canvas = Image.new("RGB", (left + cols * (cell + gap), top + rows * (size + gap)), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for c in range(cols):
        draw.text((left + c * (cell + gap) + cell // 2 - 12, 3), f"seed {c}", fill=(0, 0, 0))
    for r in range(rows):
        draw.text((4, top + r * (size + gap) + size // 2 - 6), trained.CLASSES[r], fill=(0, 0, 0))
        for c in range(cols):
            for k, frame in enumerate(picks):
                img = F.interpolate(clips[r * cols + c, frame][None], scale_factor=scale, mode="nearest")[0]
                arr = (img.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
                canvas.paste(Image.fromarray(arr), (left + c * (cell + gap) + k * size, top + r * (size + gap)))
    canvas.save(path)


def evaluate(pipe: Any, weights: Path, classifier: trained.ShapeClassifier, device: torch.device,
             seeds: int, steps: int) -> dict[str, Any]:
    labels = [c for c in range(trained.NUM_CLASSES) for _ in range(seeds)]
    seed_list = [s for _ in range(trained.NUM_CLASSES) for s in range(seeds)]
    clips = generate(pipe, weights, labels, seed_list, device, steps)
    predicted = trained.predict(classifier, clips)
    with torch.no_grad():
        frames = classifier(clips.flatten(0, 1)).argmax(-1).view(clips.shape[:2])
    frame_hits = (frames == torch.tensor(labels)[:, None]).float().mean().item()
    hits = [p == l for p, l in zip(predicted, labels)]
    per_class = {trained.CLASSES[c]: sum(hits[c * seeds:(c + 1) * seeds]) / seeds for c in range(trained.NUM_CLASSES)}
    test_hits = [h for h, s in zip(hits, seed_list) if s in TEST_SEEDS]
    return dict(samples=len(labels), seeds_per_class=seeds, steps=steps, accuracy=sum(hits) / len(hits), frame_accuracy=frame_hits,
                per_class=per_class, test_samples=len(test_hits), test_accuracy=sum(test_hits) / max(1, len(test_hits)))


def model_card(log: dict[str, Any]) -> str:
    t, e = log["transformer"], log["evaluation"]
    cfg = video.VIDEO_TRANSFORMER_CONFIG
    early = (f" **Stopped early** at {t['steps']} of {t['planned_steps']} planned steps (time guard)."
             if t["stopped_early"] else "")
    fitted = (f" `--fit-steps`: {t['planned_steps']} of the {t['requested_steps']} requested steps were planned from "
              f"the speed of the first {FIT_AFTER}." if t.get("fit_steps") else "")
    if t.get("init"):
        fitted += (f" Continued from a run of {t['previous_steps']} steps (`--init`, its EMA weights; the earlier run's "
                   "log is beside this one's), so the model has seen "
                   f"{t['previous_steps'] + t['steps']} steps of batch {t['batch']} in all.")
    per_class = "\n".join(f"| {name} | {acc:.0%} |" for name, acc in e["per_class"].items())
    quick = "\n**QUICK RUN (--quick): a check of the script, not a trained model. Do not ship.**\n" if log["quick"] else ""
    return f"""# hookkit video model (Wan architecture, trained)
{quick}
A small video model, so that hookkit's caching is judged on trained video trajectories (Wan's UniPC solver and
3D token grid) as well as on the image models. Made by `benchmarks/train_tiny_wan.py`; loaded by
`hookkit.tools.trained.load_pipeline(model="video")` into a stock `diffusers.WanPipeline` (no text encoder).

## Model
- `WanTransformer3DModel`: {cfg['num_layers']} blocks, {cfg['num_attention_heads']} heads x {cfg['attention_head_dim']}
  = {cfg['num_attention_heads'] * cfg['attention_head_dim']} hidden, FFN {cfg['ffn_dim']}, patches {tuple(cfg['patch_size'])},
  `qk_norm` {cfg['qk_norm']}, `text_dim` {cfg['text_dim']}; {t['params'] / 1e6:.2f} M parameters, shipped as float16
  (EMA weights).
- Conditioning: the image models' class embeddings (`make_conditions(0)`, 4 tokens of 64) as
  `prompt_embeds`; the null class (index {trained.NULL_CLASS}) as `negative_prompt_embeds` for CFG.
- Latents: `PatchVAE3D`, no trained autoencoder: Wan's causal layout, frame 0 alone then {video.TEMPORAL} frames per
  latent frame, each pixel-unshuffled by {video.SPATIAL}; {video.FRAMES} frames of 32x32 are a
  ({video.LATENT_CHANNELS}, 3, 16, 16) latent, {t['tokens']} tokens; normalised with mean {video.LATENT_MEAN} and std
  {video.LATENT_STD:.4f}.
- Scheduler: `UniPCMultistepScheduler` (flow prediction, flow sigmas, shift {video.VIDEO_SCHEDULER_CONFIG['flow_shift']:g}), as Wan 2.1 at 480p.

## Data
Procedural clips drawn on the fly (`shapes.render(frames={video.FRAMES})`): the image models' scenes, the shape moving
in a straight line between two random positions and turning by up to a quarter turn.

## Training
Rectified flow matching: x_t = (1 - sigma) x0 + sigma noise, target noise - x0, `timestep` = 1000 sigma; sigma
logit-normal(0, 1) with 20% uniform; class dropped to null 10% of the time. {t['steps']} steps of batch
{t['batch']}, AdamW (lr {t['lr']:g}, betas (0.9, 0.99), weight decay 0.01 on matrices), {t['warmup']} warm-up steps
then cosine to 10%, gradient clipping 1.0, EMA {t['ema']}. {t['seconds']:.0f} s on {log['device']}
({t['steps_per_second']:.2f} steps/s); final loss (mean of the last 200 steps) {t['final_loss']:.4f}.{early}{fitted}

![training loss](loss.png)

## Samples
Stock WanPipeline, {e.get('steps', SAMPLE_STEPS)} steps, no CFG; rows are classes, each cell a seed's first, middle and last frame.

![samples](samples.png)

## Classifier
The shipped image `ShapeClassifier` judges every frame; a clip is recognised when the class most of its frames show is
the class asked for. {e['seeds_per_class']} seeds per class: **{e['accuracy']:.1%}** of {e['samples']} clips
({e['frame_accuracy']:.1%} of their frames); on the {e['test_samples']} clips `tests/test_trained_video.py` checks (seeds
{', '.join(map(str, TEST_SEEDS))}): {e['test_accuracy']:.0%}.

| class | recognised |
|---|---|
{per_class}

## Reproduce
`python3 benchmarks/train_tiny_wan.py {' '.join(log.get('argv') or ['--out', 'OUT'])}` (seed {log['seed']}; torch
{log['torch']}, diffusers {log['diffusers']}); copy the files into `hookkit/tools/trained/video/`.

## Limits
A toy: 32x32, {video.FRAMES} frames, {t['tokens']} tokens, {cfg['num_layers']} blocks. It has seen
{(t.get('previous_steps', 0) + t['steps']) * t['batch']:,} clips (the image models saw 4 million images on a GPU): its
loss is far above theirs (0.08-0.10), frames after the first keep a visible grain, and some seeds draw no shape. It
shows how caching behaves on a trained video trajectory (UniPC, 3D tokens), not on a good video model; train it longer
on a GPU (`--device cuda --steps 20000 --batch 256`) for cleaner clips. Wall-time speed-ups on it are dominated by
per-call overheads.
"""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import diffusers

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"train_tiny_wan: {name}, torch {torch.__version__}, diffusers {diffusers.__version__}, seed {args.seed}"
          f"{', QUICK (not for shipping)' if args.quick else ''}", flush=True)
    classifier = trained.load_classifier(path=args.classifier)
    # A continued run keeps the class embeddings it was trained with; --seed then only draws other data.
    conditions = trained.load_conditions(args.init) if args.init else trained.make_conditions(args.seed)
    state, transformer_log = train_transformer(args, device, conditions)

    meta = dict(config=video.VIDEO_TRANSFORMER_CONFIG, architecture="WanTransformer3DModel", model=MODEL,
                seed=args.seed, quick=args.quick, steps=transformer_log["steps"], batch=args.batch,
                total_steps=transformer_log["previous_steps"] + transformer_log["steps"],
                torch=torch.__version__, diffusers=diffusers.__version__, device=name)
    model_path = out / "model.safetensors"
    trained.save_model(model_path, state, conditions, meta)

    pipe = trained.load_pipeline(device=device, dtype=torch.float32, path=model_path, model=MODEL)
    t0 = time.perf_counter()
    cols = 2 if args.quick else SAMPLE_SEEDS
    steps = 4 if args.quick else SAMPLE_STEPS
    grid = generate(pipe, model_path, [c for c in range(trained.NUM_CLASSES) for _ in range(cols)],
                    [s for _ in range(trained.NUM_CLASSES) for s in range(cols)], device, steps)
    save_grid(grid, trained.NUM_CLASSES, cols, out / "samples.png")
    evaluation = evaluate(pipe, model_path, classifier, device, 2 if args.quick else EVAL_SEEDS, steps)
    evaluation["seconds"] = time.perf_counter() - t0
    save_loss_plot(transformer_log["losses"], out / "loss.png", "hookkit video (Wan): training loss")

    log = dict(model=MODEL, argv=args.argv, seed=args.seed, quick=args.quick, precision=args.precision,
               sample_seeds=cols, device=name, torch=torch.__version__, diffusers=diffusers.__version__,
               python=platform.python_version(), classifier=str(args.classifier), transformer=transformer_log,
               evaluation=evaluation, total_seconds=time.perf_counter() - start)
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    (out / "MODEL_CARD.md").write_text(model_card(log))
    print(f"generated clips recognised by the classifier: {evaluation['accuracy']:.1%} of {evaluation['samples']} "
          f"({evaluation['frame_accuracy']:.1%} of frames); test set: {evaluation['test_accuracy']:.0%}")
    for cls, acc in evaluation["per_class"].items():
        print(f"  {cls:16s} {acc:.0%}")
    list_written(out, log["total_seconds"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
