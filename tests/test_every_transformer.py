"""Every diffusers transformer, on diffusers' own tiny test configs (`tests/data/diffusers_transformers.json`).

For every stored config (diffusers' `tests/models/transformers/` init and input dicts; see `tests/diffusers_configs.py`)
hookkit must enable with a shipped or derived adapter, and then:

- `enable(Spec())` gives a bitwise equal output and the first-call check confirms the adapter;
- `DBCache(threshold=0, warmup_steps=0)` is bitwise equal (every step computed through the hooks);
- a static mask really skips the middle blocks: a leaf module inside the last block runs on computed steps only
  (the block's own `__call__` still runs when hookkit replaces its forward, so the leaf is what is counted);
- `memo=True` is bitwise equal; regional compile (backend "eager": Dynamo tracing without codegen, to keep this
  fast on a CPU) is close to eager; `Quantize(scheme="int8_weight_only")` runs;
- disable restores every module's `__dict__` and the output bitwise;
- every boolean mask its attention hands SDPA is one hookkit's attention kernels take (six models pass additive masks,
  which stay with SDPA).

A model whose adapter has one block gets DBCache's clear error; every other runs DBCache's default F1B0 split (Wan VACE
too: its hints, added between middle blocks, are named in the adapter's `between_block_args` and counted once, as
`tests/test_cache_vace.py` checks, with the refusal an adapter without the field gets).

Transformers are called directly, three times per generation (`with handle.generation(num_steps=3)`), on the same
inputs: each call is one denoising step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hookkit
from diffusers_configs import build, configs, entry, inputs, torchvision_shim
from hookkit.core.plan import flat_blocks
from hookkit.errors import SpecError

STEPS = 3
NAMES = configs()

#: the adapter each config gets: a shipped one (adapters/*.toml) or the one derived from its code ("derived:<Class>")
ADAPTERS = {
    "AceStepTransformer1DModel": "derived:AceStepTransformer1DModel",
    "AllegroTransformer": "derived:AllegroTransformer3DModel",
    "AnyFlowFARTransformer3D": "derived:AnyFlowFARTransformer3DModel",
    "AnyFlowTransformer3D": "derived:AnyFlowTransformer3DModel",
    "AuraFlowTransformer": "derived:AuraFlowTransformer2DModel",
    "BriaFiboTransformer": "derived:BriaFiboTransformer2DModel",
    "BriaTransformer": "derived:BriaTransformer2DModel",
    "ChromaTransformer": "chroma",
    "ChronoEditTransformer": "derived:ChronoEditTransformer3DModel",
    "CogVideoX15Transformer": "cogvideox",
    "CogVideoXTransformer": "cogvideox",
    "CogView3PlusTransformer": "derived:CogView3PlusTransformer2DModel",
    "CogView4Transformer": "cogview4",
    "ConsisIDTransformer": "derived:ConsisIDTransformer3DModel",
    "Cosmos3OmniTransformer": "derived:Cosmos3OmniTransformer",
    "CosmosTransformer": "cosmos",
    "CosmosTransformerVideoToWorld": "cosmos",
    "DiTTransformer2D": "derived:DiTTransformer2DModel",
    "EasyAnimateTransformer": "derived:EasyAnimateTransformer3DModel",
    "ErnieImageTransformer": "derived:ErnieImageTransformer2DModel",
    "Flux2Transformer": "flux2",
    "FluxTransformer": "flux",
    "GlmImageTransformer": "derived:GlmImageTransformer2DModel",
    "HeliosTransformer3D": "derived:HeliosTransformer3DModel",
    "HiDreamTransformer": "hidream",
    "HunyuanDiT": "derived:HunyuanDiT2DModel",
    "HunyuanVideo15Transformer": "hunyuanvideo15",
    "HunyuanVideoFramepackTransformer": "derived:HunyuanVideoFramepackTransformer3DModel",
    "HunyuanVideoI2VTransformer": "hunyuanvideo",
    "HunyuanVideoTokenReplaceTransformer": "hunyuanvideo",
    "HunyuanVideoTransformer": "hunyuanvideo",
    "Ideogram4Transformer": "derived:Ideogram4Transformer2DModel",
    "JoyImageEditPlusTransformer": "derived:JoyImageEditPlusTransformer3DModel",
    "JoyImageEditTransformer": "derived:JoyImageEditTransformer3DModel",
    "Krea2Transformer": "derived:Krea2Transformer2DModel",
    "LTX2Transformer": "ltx2",
    "LTXTransformer": "ltxvideo",
    "LatteTransformer": "derived:LatteTransformer3DModel",
    "LongCatAudioDiTTransformer": "derived:LongCatAudioDiTTransformer",
    "LongCatImageTransformer": "derived:LongCatImageTransformer2DModel",
    "Lumina2Transformer": "lumina2",
    "LuminaNextDiT": "derived:LuminaNextDiT2DModel",
    "MiniMaxH3Transformer": "derived:MiniMaxH3Transformer3DModel",
    "MiniMaxMusic3Transformer1D": "derived:MiniMaxMusic3Transformer1DModel",
    "MochiTransformer": "mochi",
    "MotifVideoTransformer": "derived:MotifVideoTransformer3DModel",
    "NucleusMoEImageTransformer": "derived:NucleusMoEImageTransformer2DModel",
    "OmniGenTransformer": "derived:OmniGenTransformer2DModel",
    "OvisImageTransformer": "derived:OvisImageTransformer2DModel",
    "PRXTransformer": "derived:PRXTransformer2DModel",
    "PixArtTransformer2D": "derived:PixArtTransformer2DModel",
    "PriorTransformer": "derived:PriorTransformer",
    "QwenImageTransformer": "qwenimage",
    "SD35Transformer": "sd3",
    "SD3Transformer": "sd3",
    "SanaTransformer": "sana",
    "SanaVideoTransformer3D": "derived:SanaVideoTransformer3DModel",
    "SkyReelsV2Transformer": "skyreelsv2",
    "StableAudio3DiT": "derived:StableAudio3DiTModel",
    "TemporalTransformer": "derived:TransformerTemporalModel",
    "WanAnimate2Transformer": "derived:WanAnimate2Transformer3DModel",
    "WanAnimateTransformer3D": "derived:WanAnimateTransformer3DModel",
    "WanTransformer3D": "wan",
    "WanVACETransformer3D": "wan_vace",
    "ZImageTransformer": "zimage",
}

#: blocks whose code has data-dependent shapes Dynamo cannot trace as one graph: compiled with fullgraph=False
GRAPH_BREAKS = {
    "HiDreamTransformer": "MoE routing loops over a data-dependent number of tokens per expert",
    "WanAnimate2Transformer": "its RoPE slices the frequency table by grid sizes read from a tensor",
}


@pytest.fixture(autouse=True)
def _cosmos_without_torchvision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cosmos resizes its padding mask with torchvision, which the test environment lacks: the same nearest resize."""
    import diffusers.models.transformers.transformer_cosmos as cosmos

    if "transforms" not in vars(cosmos):
        monkeypatch.setattr(cosmos, "transforms", torchvision_shim(), raising=False)


def _bits(output: Any) -> torch.Tensor:
    """The output as one flat tensor of its bits: NaNs (Z-Image pads with them) compare equal to themselves."""
    if isinstance(output, (list, tuple)):
        output = torch.cat([_bits(o) for o in output])
    t = output.detach().contiguous().reshape(-1)
    if t.is_floating_point():
        t = t.float().view(torch.int32)
    return t


def call(model: torch.nn.Module, name: str) -> Any:
    with torch.no_grad():
        out = model(**inputs(name), return_dict=False)
    return out[0] if isinstance(out, tuple) else out


def generation(model: torch.nn.Module, handle: hookkit.Handle, name: str, steps: int = STEPS) -> list[Any]:
    with handle.generation(num_steps=steps, calls_per_step=1):
        return [call(model, name) for _ in range(steps)]


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    """Each config's stock output (one call; every call on the same inputs gives the same bits)."""
    return {}


def reference(references: dict[str, Any], name: str) -> torch.Tensor:
    if name not in references:
        references[name] = _bits(call(build(name), name))
    return references[name]


def num_blocks(model: torch.nn.Module) -> int:
    return len(flat_blocks(hookkit.resolve_adapter(model), model))


def leaf_calls(block: torch.nn.Module) -> Iterator[list[int]]:
    """Counts forward calls of every leaf module inside `block` (torch forward hooks, removed after)."""
    counter = [0]
    handles = [m.register_forward_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
               for m in block.modules() if not list(m.children())]
    return counter, handles


def test_every_config_gets_its_adapter_shipped_or_derived() -> None:
    got = {name: hookkit.resolve_adapter(build(name)).name for name in NAMES}
    assert got == ADAPTERS
    shipped = {entry(n)["class"] for n, a in ADAPTERS.items() if not a.startswith("derived:")}
    derived = {entry(n)["class"] for n, a in ADAPTERS.items() if a.startswith("derived:")}
    assert (len(shipped), len(derived)) == (20, 40)


@pytest.mark.parametrize("name", NAMES)
def test_enable_is_bitwise_equal_and_the_first_call_confirms_the_adapter(name: str, references: dict) -> None:
    model = build(name)
    handle = hookkit.enable(model, hookkit.Spec())
    outputs = generation(model, handle, name, steps=1)
    assert torch.equal(_bits(outputs[0]), reference(references, name))
    assert handle.summary().first_call == "confirmed"


def _dbcache_split(model: torch.nn.Module, name: str) -> tuple[int, int] | None:
    """(fn_blocks, bn_blocks) to test with, or None for a one-block model."""
    if num_blocks(model) < 2:
        return None
    return 1, 0


@pytest.mark.parametrize("name", NAMES)
def test_dbcache_at_threshold_zero_is_bitwise_equal(name: str, references: dict) -> None:
    model = build(name)
    split = _dbcache_split(model, name)
    if split is None:
        with pytest.raises(SpecError, match=r"^DBCache.fn_blocks \+ DBCache.bn_blocks: expected fewer than the 1 blocks"):
            hookkit.enable(model, hookkit.Spec(cache=hookkit.DBCache(threshold=0.0, warmup_steps=0)))
        return
    fn, bn = split
    handle = hookkit.enable(model, hookkit.Spec(cache=hookkit.DBCache(fn_blocks=fn, bn_blocks=bn, threshold=0.0,
                                                                      warmup_steps=0)))
    outputs = generation(model, handle, name)
    assert all(torch.equal(_bits(o), reference(references, name)) for o in outputs)
    assert handle.summary().features["cache"].data["branches"][0]["computed"] == [0, 1, 2]


@pytest.mark.parametrize("name", NAMES)
def test_a_static_mask_skips_the_middle_blocks(name: str) -> None:
    model = build(name)
    split = _dbcache_split(model, name)
    if split is None:
        pytest.skip("one block: DBCache refuses it (test_dbcache_at_threshold_zero_is_bitwise_equal)")
    last = flat_blocks(hookkit.resolve_adapter(model), model)[-1][2]
    counter, handles = leaf_calls(last)
    call(model, name)
    per_call = counter[0]
    counter[0] = 0
    fn, bn = split
    handle = hookkit.enable(model, hookkit.Spec(cache=hookkit.DBCache(
        fn_blocks=fn, bn_blocks=bn, warmup_steps=0, steps_mask=[1, 0, 1], mask_policy="static")))
    generation(model, handle, name)
    for h in handles:
        h.remove()
    assert per_call > 0
    assert counter[0] == 2 * per_call  # steps 0 and 2 run the last block, step 1 skips it
    assert handle.summary().features["cache"].data["branches"][0]["cached"] == [1]


@pytest.mark.parametrize("name", NAMES)
def test_memo_is_bitwise_equal(name: str, references: dict) -> None:
    model = build(name)
    handle = hookkit.enable(model, hookkit.Spec(memo=True))
    outputs = generation(model, handle, name, steps=2)
    assert all(torch.equal(_bits(o), reference(references, name)) for o in outputs)


@pytest.mark.parametrize("name", NAMES)
def test_regional_compile_is_close_to_eager(name: str) -> None:
    torch._dynamo.reset()
    model = build(name)
    expected = call(model, name)
    spec = hookkit.Compile(backend="eager", fullgraph=name not in GRAPH_BREAKS)
    handle = hookkit.enable(model, hookkit.Spec(compile=spec))
    outputs = generation(model, handle, name, steps=1)
    regions = handle.summary().features["compile"].data["regions"]
    handle.remove()
    assert regions > 0
    for out in outputs:
        torch.testing.assert_close(_flat(out), _flat(expected), rtol=1e-4, atol=1e-5, equal_nan=True)


def _flat(output: Any) -> torch.Tensor:
    if isinstance(output, (list, tuple)):
        return torch.cat([_flat(o) for o in output])
    return output.reshape(-1).float()


@pytest.mark.parametrize("name", NAMES)
def test_int8_weight_only_runs(name: str) -> None:
    model = build(name)
    expected = _flat(call(model, name))
    handle = hookkit.enable(model, hookkit.Spec(quantize=hookkit.Quantize(scheme="int8_weight_only")))
    out = _flat(generation(model, handle, name, steps=1)[0])
    assert handle.summary().features["quantize"].data["quantized"] > 0
    assert out.shape == expected.shape
    assert torch.isfinite(out).sum() == torch.isfinite(expected).sum()


def _dicts(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """Every module's `__dict__`: keys with the identity of each value (what a hook could leave or swap)."""
    return {path: {k: id(v) for k, v in vars(m).items()} for path, m in model.named_modules()}


@pytest.mark.parametrize("name", NAMES)
def test_disable_restores_every_module_exactly(name: str, references: dict) -> None:
    model = build(name)
    call(model, name)  # the model's own lazy state (AnyFlow's rope caches its tables at the first call) comes first
    before = _dicts(model)
    split = _dbcache_split(model, name)
    cache = None if split is None else hookkit.DBCache(fn_blocks=split[0], bn_blocks=split[1], warmup_steps=0,
                                                       steps_mask=[1, 0, 1], mask_policy="static")
    handle = hookkit.enable(model, hookkit.Spec(cache=cache, memo=True))
    generation(model, handle, name)
    hookkit.disable(model)
    assert _dicts(model) == before
    assert torch.equal(_bits(call(model, name)), reference(references, name))


def test_every_stored_config_is_from_diffusers_tests() -> None:
    """The data names where each config comes from (diffusers' test file and config class)."""
    assert len({entry(n)["class"] for n in NAMES}) == 60
    assert all(entry(n)["test"].startswith("tests/models/transformers/test_") for n in NAMES)


#: the models whose attention takes an additive (float) mask, which hookkit's kernels leave to SDPA ("native"); every
#: other mask diffusers' transformers pass is boolean
ADDITIVE_MASKS = {"AceStepTransformer1DModel", "CosmosTransformer", "CosmosTransformerVideoToWorld", "LTX2Transformer",
                  "LTXTransformer", "OmniGenTransformer"}


class _SDPAMasks(torch.overrides.TorchFunctionMode):
    """Records the (mask, query, key) of every SDPA call that has a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            from hookkit.techniques.attention.hooks import _sdpa_args

            a = _sdpa_args(args, kwargs)
            if a["attn_mask"] is not None:
                self.calls.append((a["attn_mask"], a["query"], a["key"]))
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_hookkits_attention_kernels_take_every_boolean_mask_the_model_passes(name: str) -> None:
    from hookkit.techniques.attention.hooks import mask_ok

    recorder = _SDPAMasks()
    model = build(name)
    with recorder:
        call(model, name)
    additive = [m for m, _, _ in recorder.calls if m.dtype != torch.bool]
    assert bool(additive) == (name in ADDITIVE_MASKS)
    assert all(mask_ok(m, q, k) for m, q, k in recorder.calls if m.dtype == torch.bool)
