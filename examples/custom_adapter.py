"""Bring your own transformer: write an adapter, register it, cache it.

hookkit knows a transformer through an adapter: which class it is (exact name), which `nn.ModuleList`s
hold its blocks in execution order, what each block takes and returns. The shipped ones live in
`adapters/*.toml`. This example defines a small diffusion transformer that hookkit has never seen, shows
the error `hookkit.enable` gives for it, writes an adapter for it (TOML, as you would in a file next to
your model), registers it with `hookkit.register_adapter`, and runs a few denoising steps with DBCache.
There is no pipeline, so each generation is marked with `with handle.generation(...)`.

    python examples/custom_adapter.py [--steps 8]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch import nn

import hookkit
from hookkit.errors import AdapterError

ADAPTER_TOML = """
# An adapter for TinyDiT (this file): one list of blocks, each cross-attending to the text.
name = "tinydit"
transformer = ["TinyDiT"]           # exact class name, never a prefix
repeated_blocks = ["TinyBlock"]     # what Compile(regional=True) compiles
quant_exclude = ["proj_in", "proj_out", "time_embed.*", "*.modulation"]
cfg = "batched"                     # CFG, if any, is one batched call per step

[[blocks]]
attr = "blocks"                     # TinyDiT.blocks, an nn.ModuleList
class = "TinyBlock"
hidden_arg = "hidden_states"        # the stream DBCache caches residuals of
encoder_arg = "encoder_hidden_states"
returns = ["hidden_states"]         # what each block returns, by position
"""


class TinyBlock(nn.Module):
    """AdaLN-modulated self-attention, cross-attention to the text, MLP."""

    def __init__(self, dim: int, text_dim: int, heads: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.modulation = nn.Linear(dim, 2 * dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.cross = nn.MultiheadAttention(dim, heads, kdim=text_dim, vdim=text_dim, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.modulation(temb).unsqueeze(1).chunk(2, dim=-1)
        h = self.norm(hidden_states) * (1 + scale) + shift
        hidden_states = hidden_states + self.attn(h, h, h, need_weights=False)[0]
        h = self.norm(hidden_states)
        hidden_states = hidden_states + self.cross(h, encoder_hidden_states, encoder_hidden_states,
                                                   need_weights=False)[0]
        return hidden_states + self.mlp(self.norm(hidden_states))


class TinyDiT(nn.Module):
    """A diffusion transformer over a sequence of latent tokens."""

    def __init__(self, channels: int = 4, dim: int = 32, text_dim: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.proj_in = nn.Linear(channels, dim)
        self.time_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList(TinyBlock(dim, text_dim) for _ in range(depth))
        self.proj_out = nn.Linear(dim, channels)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                timestep: torch.Tensor) -> torch.Tensor:
        temb = self.time_embed(timestep.reshape(-1, 1))
        x = self.proj_in(hidden_states)
        for block in self.blocks:
            x = block(x, encoder_hidden_states=encoder_hidden_states, temb=temb)
        return self.proj_out(x)


@torch.no_grad()
def generate(model: TinyDiT, text: torch.Tensor, steps: int, seed: int = 0) -> torch.Tensor:
    """Flow-matching Euler sampling from noise (t: 1 -> 0)."""
    x = torch.randn(text.shape[0], 64, 4, generator=torch.Generator().manual_seed(seed))
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    for i in range(steps):
        t = sigmas[i].expand(x.shape[0])
        velocity = model(x, text, t)
        x = x + (sigmas[i + 1] - sigmas[i]) * velocity
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = TinyDiT().eval()
    text = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(1))
    reference = generate(model, text, args.steps)

    try:
        hookkit.enable(model)
    except AdapterError as exc:
        print(f"before registering: AdapterError: {str(exc).split('. ')[0]}.")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tinydit.toml"
        path.write_text(ADAPTER_TOML)
        adapter = hookkit.register_adapter(path)
    print(f"registered adapter {adapter.name!r} for {list(adapter.transformer)}: "
          f"{sum(len(getattr(model, b.attr)) for b in adapter.blocks)} blocks in {[b.attr for b in adapter.blocks]}")

    # First block always computed (fn_blocks=1); on the steps the mask marks 0, the other five blocks are
    # skipped and their cached residual is added instead. `static`: the mask alone decides (random weights
    # never pass a dynamic threshold).
    mask = [1, 1, 0, 0, 1, 0, 0, 1][: args.steps]
    spec = hookkit.Spec(cache=hookkit.DBCache(fn_blocks=1, bn_blocks=0, warmup_steps=0, steps_mask=mask,
                                              mask_policy="static"))
    handle = hookkit.enable(model, spec)
    with handle.generation(num_steps=args.steps):
        cached_out = generate(model, text, args.steps)
    summary = handle.summary()
    print(summary)
    cached = summary.features["cache"].data["branches"][0]["cached"]
    print(f"cached steps: {cached} of {args.steps}")
    mse = torch.mean((cached_out - reference) ** 2).item()
    print(f"cached output vs uncached: relative MSE {mse / torch.mean(reference ** 2).item():.2e}")

    handle.remove()
    after = generate(model, text, args.steps)
    print(f"bitwise equal to the unhooked run after handle.remove(): {torch.equal(after, reference)}")
    leftovers = [k for m in model.modules() for k in vars(m) if "hookkit" in k or k == "forward"]
    print(f"nothing left on the model: {not leftovers}")


if __name__ == "__main__":
    main()
