"""Adapters: shipped TOML files load, validate and match their tiny models; errors say how to fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel

import hookkit
from hookkit import zoo
from hookkit.adapters import adapters_dir, derive_adapter
from hookkit.errors import AdapterError

SHIPPED = {
    "flux": ("FluxTransformer2DModel", ("transformer_blocks", "single_transformer_blocks")),
    "qwenimage": ("QwenImageTransformer2DModel", ("transformer_blocks",)),
    "cogvideox": ("CogVideoXTransformer3DModel", ("transformer_blocks",)),
    "wan": ("WanTransformer3DModel", ("blocks",)),
    "sd3": ("SD3Transformer2DModel", ("transformer_blocks",)),
    "hunyuanvideo": ("HunyuanVideoTransformer3DModel", ("transformer_blocks", "single_transformer_blocks")),
}


def test_every_shipped_adapter_file_is_registered() -> None:
    files = sorted(p.stem for p in adapters_dir().glob("*.toml"))
    assert files == sorted(SHIPPED)
    assert set(SHIPPED) <= set(hookkit.list_adapters())


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_adapter_matches_its_tiny_model(name: str) -> None:
    transformer = zoo.tiny_transformer(name)
    adapter = hookkit.resolve_adapter(transformer)
    cls_name, block_attrs = SHIPPED[name]
    assert adapter.name == name
    assert adapter.transformer == (cls_name,)
    assert tuple(b.attr for b in adapter.blocks) == block_attrs
    adapter.check(transformer)  # every block's class and argument names verified


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_adapter_agrees_with_diffusers_block_metadata(name: str) -> None:
    """Where diffusers registers the block classes, its return order equals ours."""
    transformer = zoo.tiny_transformer(name)
    ours = {b.attr: b.returns for b in hookkit.get_adapter(name).blocks}
    derived = {b.attr: b.returns for b in derive_adapter(transformer).blocks}
    for attr, returns in derived.items():
        assert ours[attr] == returns


def test_flux_and_qwen_blocks_return_encoder_stream_first() -> None:
    for name in ("flux", "qwenimage"):
        for block in hookkit.get_adapter(name).blocks:
            assert block.returns == ("encoder_hidden_states", "hidden_states")
            assert (block.hidden_index, block.encoder_index) == (1, 0)


def test_cogvideox_adapter_supplies_repeated_blocks_its_class_lacks() -> None:
    transformer = zoo.tiny_transformer("cogvideox")
    assert not getattr(transformer, "_repeated_blocks", None)
    assert hookkit.get_adapter("cogvideox").repeated_blocks == ("CogVideoXBlock",)


def test_a_wrong_adapter_gives_the_clear_error() -> None:
    with pytest.raises(AdapterError, match=r"adapter 'wan' .*field 'transformer' expected to list the class 'FluxTransformer2DModel'"):
        hookkit.get_adapter("wan").check(zoo.tiny_transformer("flux"))


def test_matching_is_by_exact_class_never_by_prefix_or_subclass() -> None:
    class MyFlux(FluxTransformer2DModel):
        pass

    sub = MyFlux(**zoo.TINY_CONFIGS["flux"])
    assert not hookkit.get_adapter("flux").matches(sub)
    adapter = hookkit.resolve_adapter(sub)  # falls back to diffusers' metadata
    assert adapter.name == "derived:MyFlux"
    assert [b.attr for b in adapter.blocks] == ["transformer_blocks", "single_transformer_blocks"]


def test_a_model_without_metadata_gets_an_error_pointing_to_the_example() -> None:
    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    with pytest.raises(AdapterError, match=r"no adapter for Plain .*examples/custom_adapter.py"):
        hookkit.resolve_adapter(Plain())


def test_block_class_mismatch_names_the_block_path() -> None:
    spec = hookkit.AdapterSpec(
        name="bad", transformer=["FluxTransformer2DModel"],
        blocks=[hookkit.BlockListSpec(attr="transformer_blocks", classes=["FluxSingleTransformerBlock"],
                                      encoder_arg="encoder_hidden_states",
                                      returns=["encoder_hidden_states", "hidden_states"])],
    )
    with pytest.raises(AdapterError, match=r"blocks\[transformer_blocks\].classes.*transformer_blocks.0.*'FluxTransformerBlock'"):
        spec.check(zoo.tiny_transformer("flux"))


def test_wrong_argument_name_is_reported_with_the_real_ones() -> None:
    spec = hookkit.AdapterSpec(
        name="bad", transformer=["WanTransformer3DModel"],
        blocks=[hookkit.BlockListSpec(attr="blocks", classes=["WanTransformerBlock"], hidden_arg="x")],
    )
    with pytest.raises(AdapterError, match=r"hidden_arg' expected an argument of WanTransformerBlock.forward \(\['hidden_states'"):
        spec.check(zoo.tiny_transformer("wan"))


def test_returns_must_name_known_streams() -> None:
    with pytest.raises(AdapterError, match=r"blocks\[blocks\].returns"):
        hookkit.AdapterSpec(name="bad", transformer=["X"],
                            blocks=[hookkit.BlockListSpec(attr="blocks", classes=["B"], returns=["hidden", "enc"])])


def test_toml_with_unknown_key_names_it(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('name = "mine"\ntransformer = ["X"]\ncfg_style = "batched"\n[[blocks]]\nattr = "b"\nclass = "B"\n')
    with pytest.raises(AdapterError, match=r"field 'cfg_style' expected one of the known keys"):
        hookkit.register_adapter(path)


def test_register_adapter_from_toml_at_run_time(tmp_path: Path) -> None:
    path = tmp_path / "flux_sub.toml"
    text = (adapters_dir() / "flux.toml").read_text().replace('name = "flux"', 'name = "flux-sub"')
    path.write_text(text.replace('transformer = ["FluxTransformer2DModel"]', 'transformer = ["FluxSub"]'))
    adapter = hookkit.register_adapter(path)
    try:
        FluxSub = type("FluxSub", (FluxTransformer2DModel,), {})
        assert hookkit.resolve_adapter(FluxSub(**zoo.TINY_CONFIGS["flux"])) is adapter
    finally:
        hookkit.unregister_adapter("flux-sub")


def test_two_adapters_cannot_claim_one_class() -> None:
    clone = hookkit.AdapterSpec.from_dict({**_flux_dict(), "name": "flux-copy"})
    with pytest.raises(AdapterError, match=r"claims \['FluxTransformer2DModel'\], already claimed by adapter 'flux'"):
        hookkit.register_adapter(clone)


def _flux_dict() -> dict:
    import tomllib

    return tomllib.loads((adapters_dir() / "flux.toml").read_text())


def test_a_block_without_an_encoder_argument_leaves_encoder_arg_out(tmp_path: Path) -> None:
    path = tmp_path / "plain.toml"
    path.write_text('name = "plain"\ntransformer = ["Plain"]\n[[blocks]]\nattr = "layers"\nclass = "Block"\n')
    block = hookkit.AdapterSpec.from_toml(path).blocks[0]
    assert (block.encoder_arg, block.returns) == (None, ("hidden_states",))


def test_returning_the_encoder_stream_needs_its_argument_name() -> None:
    with pytest.raises(AdapterError, match=r"encoder_arg' expected an argument name, since the block returns the encoder stream"):
        hookkit.BlockListSpec(attr="b", classes=["B"], returns=["encoder_hidden_states", "hidden_states"]).validate("x")
