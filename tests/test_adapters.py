"""Adapters: shipped TOML files load, validate and match their tiny models; errors say how to fix."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import attrs

import pytest
import torch
from diffusers import FluxTransformer2DModel

import hookkit
from hookkit.tools import zoo
from hookkit.adapters import adapters_dir, derive_adapter
from hookkit.core.registry import registry_names
from hookkit.errors import AdapterError, SpecError
from hookkit.techniques.quantize.torchao import select_layers

SHIPPED = {
    "flux": ("FluxTransformer2DModel", ("transformer_blocks", "single_transformer_blocks")),
    "qwenimage": ("QwenImageTransformer2DModel", ("transformer_blocks",)),
    "cogvideox": ("CogVideoXTransformer3DModel", ("transformer_blocks",)),
    "wan": ("WanTransformer3DModel", ("blocks",)),
    "sd3": ("SD3Transformer2DModel", ("transformer_blocks",)),
    "hunyuanvideo": ("HunyuanVideoTransformer3DModel", ("transformer_blocks", "single_transformer_blocks")),
}

#: shipped adapters checked on diffusers' own tiny test config of their class (tests/data): adapter -> (config, lists)
SHIPPED_ON_DIFFUSERS_CONFIGS = {
    "flux2": ("Flux2Transformer", ("single_transformer_blocks",)),
    "wan_vace": ("WanVACETransformer3D", ("blocks",)),
    "hunyuanvideo15": ("HunyuanVideo15Transformer", ("transformer_blocks",)),
    "ltxvideo": ("LTXTransformer", ("transformer_blocks",)),
    "ltx2": ("LTX2Transformer", ("transformer_blocks",)),
    "chroma": ("ChromaTransformer", ("single_transformer_blocks",)),
    "hidream": ("HiDreamTransformer", ("single_stream_blocks",)),
    "lumina2": ("Lumina2Transformer", ("layers",)),
    "sana": ("SanaTransformer", ("transformer_blocks",)),
    "cogview4": ("CogView4Transformer", ("transformer_blocks",)),
    "zimage": ("ZImageTransformer", ("layers",)),
    "mochi": ("MochiTransformer", ("transformer_blocks",)),
    "skyreelsv2": ("SkyReelsV2Transformer", ("blocks",)),
    "cosmos": ("CosmosTransformer", ("transformer_blocks",)),
}


def test_every_shipped_adapter_file_is_registered() -> None:
    files = sorted(p.stem for p in adapters_dir().glob("*.toml"))
    assert files == sorted([*SHIPPED, *SHIPPED_ON_DIFFUSERS_CONFIGS])
    assert set(files) <= set(hookkit.list_adapters())


@pytest.mark.parametrize("name", sorted(SHIPPED_ON_DIFFUSERS_CONFIGS))
def test_shipped_adapter_matches_diffusers_tiny_config_and_what_its_code_says(name: str) -> None:
    from diffusers_configs import build

    config, block_attrs = SHIPPED_ON_DIFFUSERS_CONFIGS[name]
    transformer = build(config)
    adapter = hookkit.resolve_adapter(transformer)
    assert adapter.name == name
    assert tuple(b.attr for b in adapter.blocks) == block_attrs
    derived = derive_adapter(transformer)
    assert adapter.blocks == derived.blocks  # the code still reads as the shipped tables say
    present = {n for n, c in transformer.named_children() if isinstance(c, torch.nn.ModuleList) and len(c)}
    assert present - set(block_attrs) <= set(adapter.left_out_reasons)  # every other list named, with a reason


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
    with pytest.raises(AdapterError, match=r"adapter 'wan' .*transformer: expected to list the class 'FluxTransformer2DModel'"):
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
    with pytest.raises(AdapterError, match=r"hidden_arg: expected an argument of WanTransformerBlock.forward \(\['hidden_states'"):
        spec.check(zoo.tiny_transformer("wan"))


def test_returns_must_name_known_streams() -> None:
    with pytest.raises(AdapterError, match=r"blocks\[blocks\].returns"):
        hookkit.AdapterSpec(name="bad", transformer=["X"],
                            blocks=[hookkit.BlockListSpec(attr="blocks", classes=["B"], returns=["hidden", "enc"])])


def test_toml_with_unknown_key_names_it(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('name = "mine"\ntransformer = ["X"]\ncfg_style = "batched"\n[[blocks]]\nattr = "b"\nclass = "B"\n')
    with pytest.raises(AdapterError, match=r"cfg_style: expected one of the known keys"):
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
    with pytest.raises(AdapterError, match=r"encoder_arg: expected an argument name, since the block returns the encoder stream"):
        hookkit.BlockListSpec(attr="b", classes=["B"], returns=["encoder_hidden_states", "hidden_states"]).validate("x")


# --- return order and argument names are checked against diffusers' block metadata ----------------------


def _flux_with_block(**changes) -> hookkit.AdapterSpec:
    """The shipped flux adapter with its first [[blocks]] table changed."""
    data = _flux_dict()
    data["blocks"][0].update(changes)
    return hookkit.AdapterSpec.from_dict({**data, "name": "flux-edited"}, source="edited")


def test_a_return_order_diffusers_contradicts_fails_at_enable_with_the_block_path() -> None:
    adapter = _flux_with_block(returns=["hidden_states", "encoder_hidden_states"])
    transformer = zoo.tiny_transformer("flux")
    with pytest.raises(AdapterError) as info:
        hookkit.enable(transformer, hookkit.Spec(), adapter=adapter)
    assert str(info.value) == (
        "adapter 'flux-edited' (edited).blocks[transformer_blocks].returns: expected ['encoder_hidden_states', "
        "'hidden_states'], the return order diffusers registers for FluxTransformerBlock (transformer_blocks.0), got "
        "['hidden_states', 'encoder_hidden_states']. Set returns = ['encoder_hidden_states', 'hidden_states']."
    )
    assert [m for m in transformer.modules() if "forward" in m.__dict__] == []  # nothing was attached


def test_an_encoder_arg_diffusers_contradicts_is_rejected() -> None:
    adapter = _flux_with_block(encoder_arg="temb")
    with pytest.raises(AdapterError, match=r"blocks\[transformer_blocks\].encoder_arg: expected 'encoder_hidden_states', "
                                           r"the argument diffusers registers for FluxTransformerBlock \(transformer_blocks.0\), "
                                           r"got 'temb'. Set encoder_arg = 'encoder_hidden_states'."):
        adapter.check(zoo.tiny_transformer("flux"))


def test_an_argument_missing_from_forward_names_the_block_path_and_the_fix() -> None:
    adapter = _flux_with_block(hidden_arg="x")
    with pytest.raises(AdapterError) as info:
        adapter.check(zoo.tiny_transformer("flux"))
    assert str(info.value) == (
        "adapter 'flux-edited' (edited).blocks[transformer_blocks].hidden_arg: expected an argument of "
        "FluxTransformerBlock.forward (['hidden_states', 'encoder_hidden_states', 'temb', 'image_rotary_emb', "
        "'joint_attention_kwargs']) for transformer_blocks.0, got 'x'. Set hidden_arg to the name "
        "FluxTransformerBlock.forward gives that stream."
    )


# --- repeated_blocks -----------------------------------------------------------------------------------


def test_hunyuanvideo_adapter_covers_the_token_replace_blocks_of_image_to_video() -> None:
    plain = zoo.tiny_transformer("hunyuanvideo")
    token_replace = zoo.tiny_transformer("hunyuanvideo", image_condition_type="token_replace")
    assert type(token_replace.transformer_blocks[0]).__name__ == "HunyuanVideoTokenReplaceTransformerBlock"
    assert hookkit.resolve_adapter(token_replace).name == "hunyuanvideo"
    spec = hookkit.Quantize(scheme="int8_weight_only")
    chosen = {name: {d.path for d in select_layers(t, spec).chosen} for name, t in
              (("plain", plain), ("token_replace", token_replace))}
    assert len(chosen["plain"]) == 34
    assert chosen["token_replace"] == chosen["plain"]


def test_a_repeated_class_the_model_lacks_must_be_a_block_variant() -> None:
    adapter = hookkit.AdapterSpec.from_dict({**_flux_dict(), "name": "flux-typo", "repeated_blocks": ["FluxBlock"]},
                                            source="typo")
    with pytest.raises(AdapterError) as info:
        adapter.check(zoo.tiny_transformer("flux"))
    assert str(info.value) == (
        "adapter 'flux-typo' (typo).repeated_blocks: expected classes that occur inside FluxTransformer2DModel, "
        "got ['FluxBlock']. Remove them, or list them as a `class` of a [[blocks]] table if they are block variants."
    )


# --- matching: bare names, dotted paths, ambiguity --------------------------------------------------------


def _flux_named(name: str, *classes: str) -> hookkit.AdapterSpec:
    return hookkit.AdapterSpec.from_dict({**_flux_dict(), "name": name, "transformer": list(classes)})


def test_a_dotted_path_names_the_class_itself_not_a_same_named_one() -> None:
    transformer = zoo.tiny_transformer("flux")
    Impostor = type("FluxTransformer2DModel", (FluxTransformer2DModel,), {"__module__": "elsewhere"})
    impostor = Impostor(**zoo.TINY_CONFIGS["flux"])
    for path in ("diffusers.FluxTransformer2DModel", "diffusers.models.transformers.transformer_flux.FluxTransformer2DModel"):
        adapter = _flux_named("dotted", path)
        assert adapter.match_level(transformer) == 2
        assert adapter.match_level(impostor) == 0
    assert _flux_named("dotted", "elsewhere.FluxTransformer2DModel").match_level(transformer) == 0
    assert hookkit.get_adapter("flux").match_level(transformer) == 1


@pytest.mark.parametrize(("classes", "matched"), [
    (["adapter_named_module.FluxTransformer2DModel",
      "diffusers.models.transformers.transformer_flux.FluxTransformer2DModel"], True),
    (["adapter_named_module.FluxTransformer2DModel"], False),
])
def test_matching_an_adapter_never_imports_a_module_it_names(classes: list[str], matched: bool, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.adapters.derive import adapter_toml

    marker = tmp_path / "imported"
    (tmp_path / "adapter_named_module").mkdir()
    (tmp_path / "adapter_named_module" / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()  # code an adapter file would run if hookkit imported what it names\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "named.toml"
    path.write_text(adapter_toml(_flux_named("named", *classes)))
    adapter = hookkit.register_adapter(path)
    try:
        transformer = zoo.tiny_transformer("flux")
        assert adapter.matches(transformer) is matched
        if matched:  # the real class, by its dotted path; enable resolves and checks it
            hookkit.enable(transformer, hookkit.Spec(memo=True)).remove()
            assert hookkit.resolve_adapter(transformer) is adapter
    finally:
        hookkit.unregister_adapter("named")
    assert (marker.exists(), "adapter_named_module" in sys.modules) == (False, False)


def test_an_adapter_registered_by_dotted_path_wins_over_the_shipped_bare_name() -> None:
    adapter = hookkit.register_adapter(_flux_named("my-flux", "diffusers.FluxTransformer2DModel"))
    try:
        assert hookkit.resolve_adapter(zoo.tiny_transformer("flux")) is adapter
    finally:
        hookkit.unregister_adapter("my-flux")
    assert hookkit.resolve_adapter(zoo.tiny_transformer("flux")).name == "flux"


def test_two_adapters_claiming_one_class_by_different_paths_are_ambiguous() -> None:
    hookkit.register_adapter(_flux_named("a", "diffusers.FluxTransformer2DModel"))
    hookkit.register_adapter(_flux_named("b", "diffusers.models.transformers.transformer_flux.FluxTransformer2DModel"))
    try:
        with pytest.raises(AdapterError, match=r"^adapters \['a', 'b'\] all claim diffusers.models.transformers."
                                               r"transformer_flux.FluxTransformer2DModel; expected exactly one. "
                                               r"Unregister all but one"):
            hookkit.resolve_adapter(zoo.tiny_transformer("flux"))
    finally:
        hookkit.unregister_adapter("a")
        hookkit.unregister_adapter("b")


def test_flux2_is_not_flux_and_caches_within_its_single_blocks() -> None:
    from diffusers import Flux2Transformer2DModel

    flux2 = Flux2Transformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
                                    num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 2, 2))
    adapter = hookkit.resolve_adapter(flux2)
    assert adapter.name == "flux2"
    # the double blocks run before forward concatenates the streams: a stage of their own, always computed
    assert [(b.attr, b.classes, b.returns) for b in adapter.blocks] == [
        ("single_transformer_blocks", ("Flux2SingleTransformerBlock",), ("hidden_states",))]
    assert set(adapter.left_out_reasons) == {"transformer_blocks"}
    assert adapter.repeated_blocks == ("Flux2TransformerBlock", "Flux2SingleTransformerBlock")


# --- derived adapters ------------------------------------------------------------------------------------


def test_a_derived_adapter_drops_repeated_classes_the_model_does_not_build() -> None:
    Variant = type("FluxVariant", (FluxTransformer2DModel,),
                   {"_repeated_blocks": ["FluxTransformerBlock", "FluxSingleTransformerBlock", "FluxOnlyInSomeConfigs"]})
    adapter = hookkit.resolve_adapter(Variant(**zoo.TINY_CONFIGS["flux"]))
    assert adapter.repeated_blocks == ("FluxTransformerBlock", "FluxSingleTransformerBlock")


def test_without_repeated_blocks_every_registered_block_list_is_derived() -> None:
    transformer = zoo.tiny_transformer("sd3")
    assert transformer._repeated_blocks == []
    adapter = derive_adapter(transformer)
    assert [(b.attr, b.classes, b.returns) for b in adapter.blocks] == [
        ("transformer_blocks", ("JointTransformerBlock",), ("encoder_hidden_states", "hidden_states"))]
    assert adapter.repeated_blocks == ("JointTransformerBlock",)


# --- TOML loading ---------------------------------------------------------------------------------------


def test_a_blocks_table_with_both_class_and_classes_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "both.toml"
    path.write_text('name = "both"\ntransformer = ["X"]\n[[blocks]]\nattr = "b"\nclass = "B"\nclasses = ["C"]\n')
    with pytest.raises(AdapterError, match=r"blocks\[b\].classes: expected to be absent, since 'class' is given, "
                                           r"got \['C'\]. Keep one of 'class' and 'classes'."):
        hookkit.AdapterSpec.from_toml(path)


def test_a_directory_is_no_adapter_file(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match=rf"^adapter file '{tmp_path}' cannot be read \(Is a directory\); pass the path"):
        hookkit.register_adapter(tmp_path)


@pytest.mark.parametrize("value", ["[" * 5000 + "]" * 5000, "{a = " * 5000 + "1" + "}" * 5000],
                         ids=["arrays", "inline-tables"])
def test_a_deeply_nested_value_is_an_adapter_error_naming_the_file(value: str, tmp_path: Path) -> None:
    path = tmp_path / "deep.toml"
    path.write_text('name = "deep"\ntransformer = ' + value + "\n")
    with pytest.raises(AdapterError) as info:
        hookkit.AdapterSpec.from_toml(path)
    assert str(info.value) == (
        f"adapter file '{path}': expected values nested at most a few levels (lists of strings, [[tables]], inline "
        "tables), got arrays or tables nested too deeply to read (Python's recursion limit). Flatten the nested "
        "value; the files in adapters/ show the shape of every key.")


def test_a_missing_required_key_says_how_to_add_it() -> None:
    with pytest.raises(AdapterError) as info:
        hookkit.AdapterSpec.from_dict({"name": "x", "blocks": [{"attr": "b", "class": "B"}]})
    assert str(info.value) == "adapter 'x' (dict).transformer: expected to be present, got None. " \
                              "Add `transformer = ...` (see the files in adapters/)."


# --- zoo -------------------------------------------------------------------------------------------------


def test_tiny_sd3_and_hunyuanvideo_run_a_forward() -> None:
    """The two families without a tiny pipeline: their configs build models that run."""
    sd3 = zoo.tiny_transformer("sd3")
    out = sd3(hidden_states=torch.randn(1, 4, 16, 16), encoder_hidden_states=torch.randn(1, 5, 16),
              pooled_projections=torch.randn(1, 16), timestep=torch.tensor([10.0]), return_dict=False)[0]
    assert out.shape == (1, 4, 16, 16)
    hunyuan = zoo.tiny_transformer("hunyuanvideo")
    out = hunyuan(hidden_states=torch.randn(1, 4, 3, 4, 4), timestep=torch.tensor([10]),
                  encoder_hidden_states=torch.randn(1, 6, 16), encoder_attention_mask=torch.ones(1, 6),
                  pooled_projections=torch.randn(1, 8), guidance=torch.tensor([3500.0]), return_dict=False)[0]
    assert out.shape == (1, 4, 3, 4, 4)


def test_call_kwargs_of_a_model_without_a_tiny_pipeline_is_an_adapter_error() -> None:
    with pytest.raises(AdapterError, match=r"^no built-in tiny pipeline 'mochi'; known: \['cogvideox', 'flux', 'hunyuanvideo15', 'qwenimage', 'wan'\]"):
        zoo.call_kwargs("mochi")


def test_full_call_kwargs_refuse_a_model_without_a_full_pipeline() -> None:
    with pytest.raises(AdapterError, match=r"^no full-size pipeline builder for 'wan'; known: \['cogvideox', 'flux', 'qwenimage'\]"):
        zoo.full_call_kwargs("wan", device="cpu")


def test_full_sd3_is_the_published_sd3_medium_architecture() -> None:
    with torch.device("meta"):
        sd3 = zoo.full_transformer("sd3")
    assert (len(sd3.transformer_blocks), sd3.inner_dim) == (24, 1536)
    assert sum(p.numel() for p in sd3.parameters()) == 2_028_328_000


def test_a_broken_adapter_file_raises_on_every_lookup_not_just_the_first(tmp_path: Path, monkeypatch) -> None:
    """A registry left half-loaded after the first error would silently lack every adapter after the bad file."""
    from hookkit.adapters import registry as adapters

    (tmp_path / "a.toml").write_text((adapters_dir() / "flux.toml").read_text())
    (tmp_path / "b.toml").write_text('name = "b"\n')
    (tmp_path / "c.toml").write_text((adapters_dir() / "wan.toml").read_text())
    monkeypatch.setattr(adapters, "adapters_dir", lambda: tmp_path)
    registry = adapters._Registry()
    for _ in range(2):
        with pytest.raises(AdapterError, match=rf"^adapter 'b' \({tmp_path / 'b.toml'}\).transformer: expected to be present"):
            registry.all()
    (tmp_path / "b.toml").unlink()
    assert sorted(registry.all()) == ["flux", "wan"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"transformer": 5}, "transformer: expected a list of non-empty strings (at least one), got 5."),
        ({"blocks": []}, "blocks: expected at least one [[blocks]] table (BlockListSpec), got ()."),
        ({"blocks": [{"attr": "b", "class": []}]}, "blocks[b].classes: expected a list of non-empty strings "
                                                   "(at least one), got ()."),
        ({"blocks": [{"attr": "b", "class": "B", "hidden_arg": 3}]}, "blocks[b].hidden_arg: expected an "
                                                                      "argument name, got 3."),
        ({"cfg": "twice"}, "cfg: expected one of ('batched', 'separate') (one batched call per step, or one "
                           "call per CFG branch), got 'twice'."),
        ({"quant_modulation": [""]}, "quant_modulation: expected a list of non-empty strings, got ('',)."),
        ({"quant_exclude": "proj_out"}, None),  # one string is a list of one
    ],
)
def test_malformed_values_name_the_field_what_was_expected_and_what_came(change: dict, message: str | None) -> None:
    data = {"name": "m", "transformer": ["X"], "blocks": [{"attr": "b", "class": "B"}], **change}
    if message is None:
        assert hookkit.AdapterSpec.from_dict(data).quant_exclude == ("proj_out",)
        return
    with pytest.raises(AdapterError) as info:
        hookkit.AdapterSpec.from_dict(data)
    assert str(info.value) == f"adapter 'm' (dict).{message}"


def test_registering_a_name_twice_needs_replace(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('name = "mine"\ntransformer = ["Mine"]\n[[blocks]]\nattr = "b"\nclass = "B"\n')
    first = hookkit.register_adapter(path)
    try:
        with pytest.raises(AdapterError, match=r"^an adapter named 'mine' is already registered \(.*mine.toml\); "
                                               r"pass replace=True"):
            hookkit.register_adapter(path)
        second = hookkit.register_adapter(hookkit.AdapterSpec.from_toml(path), replace=True)
        assert hookkit.get_adapter("mine") is second and second is not first
    finally:
        hookkit.unregister_adapter("mine")


def test_register_adapter_takes_a_path_or_a_spec_only() -> None:
    with pytest.raises(AdapterError, match=r"^register_adapter: expected a path to a .toml file or a "
                                           r"hookkit.AdapterSpec, got \{'name': 'x'\}."):
        hookkit.register_adapter({"name": "x"})  # type: ignore[arg-type]


# --- derived from the model's code (diffusers' tiny test configs, tests/data) -----------------------------


def _tiny(config: str, **overrides):
    from diffusers_configs import build

    return build(config, **overrides)


def test_z_image_block_takes_x_and_the_disagreeing_metadata_is_a_note() -> None:
    adapter = derive_adapter(_tiny("ZImageTransformer"))
    assert [(b.attr, b.hidden_arg, b.returns) for b in adapter.blocks] == [("layers", "x", ("hidden_states",))]
    assert adapter.notes == ("diffusers registers ZImageTransformerBlock's hidden argument as 'hidden_states'; its "
                             "forward takes 'x': the code is used",)
    assert set(adapter.left_out_reasons) == {"noise_refiner", "context_refiner"}
    assert adapter.left_out_reasons["noise_refiner"].startswith("runs on `x`, not on `unified`")


def test_bria_blocks_return_the_encoder_stream_first_whatever_the_metadata_says() -> None:
    adapter = derive_adapter(_tiny("BriaTransformer"))
    assert [(b.attr, b.returns) for b in adapter.blocks] == [
        ("transformer_blocks", ("encoder_hidden_states", "hidden_states")),
        ("single_transformer_blocks", ("encoder_hidden_states", "hidden_states")),
    ]
    assert adapter.notes[0].startswith("diffusers registers BriaTransformerBlock as returning ['hidden_states']; its "
                                       "code returns ['encoder_hidden_states', 'hidden_states']")
    assert adapter.left_out == ()


def test_wan_vace_leaves_the_vace_blocks_out_with_the_reason_in_the_summary() -> None:
    transformer = _tiny("WanVACETransformer3D")
    handle = hookkit.enable(transformer, hookkit.Spec())
    summary = handle.summary()
    assert summary.adapter == "wan_vace"
    assert summary.left_out == {"vace_blocks": "runs on `control_hidden_states`, not on `hidden_states`, the stream "
                                               "the last blocks carry (a refiner or side stage; it always runs)"}
    assert "block lists the adapter leaves out:" in str(summary) and "vace_blocks" in str(summary)


def test_a_list_called_inside_another_lists_loop_is_left_out() -> None:
    adapter = derive_adapter(_tiny("WanAnimateTransformer3D"))
    assert [b.attr for b in adapter.blocks] == ["blocks"]
    assert adapter.left_out_reasons["face_adapter"].startswith("runs inside the loop over blocks")


def test_lists_before_the_stream_is_rebuilt_are_a_stage_of_their_own() -> None:
    adapter = derive_adapter(_tiny("Lumina2Transformer"))
    assert [b.attr for b in adapter.blocks] == ["layers"]
    assert adapter.left_out_reasons["noise_refiner"].startswith(
        "runs before Lumina2Transformer2DModel.forward rebuilds `hidden_states`")


def test_hunyuan_dit_long_skips_are_marked_and_dbcache_refuses_a_split_that_cuts_one() -> None:
    transformer = _tiny("HunyuanDiT", num_layers=4)
    adapter = derive_adapter(transformer)
    assert [(b.attr, b.long_skips) for b in adapter.blocks] == [("blocks", True)]
    with pytest.raises(SpecError, match=r"cuts the skip blocks.0 -> blocks.3\. Use fn_blocks == bn_blocks"):
        hookkit.enable(transformer, hookkit.Spec(cache=hookkit.DBCache(rule="threshold", fn_blocks=1, bn_blocks=0)))
    handle = hookkit.enable(transformer, hookkit.Spec(cache=hookkit.DBCache(rule="threshold", fn_blocks=1,
                                                                            bn_blocks=1)))
    assert [t for t, _ in handle.plan.targets("cache")] == ["blocks.0", "blocks.1", "blocks.2"]


def test_a_model_whose_lists_alternate_in_one_loop_keeps_the_first_and_names_the_other() -> None:
    adapter = derive_adapter(_tiny("LatteTransformer"))
    assert [b.attr for b in adapter.blocks] == ["transformer_blocks"]
    assert adapter.left_out_reasons["temporal_transformer_blocks"].startswith(
        "runs inside the loop over transformer_blocks")


def test_the_derived_toml_registers_back_to_the_same_adapter(tmp_path: Path) -> None:
    from hookkit.adapters.derive import adapter_toml

    derived = derive_adapter(_tiny("BriaTransformer"))
    path = tmp_path / "bria.toml"
    path.write_text(adapter_toml(derived))
    registered = hookkit.register_adapter(path)
    try:
        assert attrs.evolve(registered, source=derived.source) == derived
    finally:
        hookkit.unregister_adapter(registered.name)


def test_cli_adapter_derive_prints_the_toml_of_a_class(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from hookkit.tools.cli import main

    assert main(["adapter", "derive", "ZImageTransformer2DModel"]) == 0
    text = capsys.readouterr().out
    path = tmp_path / "z.toml"
    path.write_text(text)
    adapter = hookkit.AdapterSpec.from_toml(path)
    assert [(b.attr, b.hidden_arg) for b in adapter.blocks] == [("layers", "x")]
    assert main(["adapter", "derive", "NoSuchTransformer"]) == 2
    assert "names no class" in capsys.readouterr().err


def _folder_naming_a_shipped_package(tmp_path: Path) -> tuple[Path, Path]:
    """A model folder whose config.json names `evil_pkg.Model`, a package shipped next to it (its parent on sys.path)
    whose import writes a marker file; returns the folder and the marker's path."""
    import json

    marker = tmp_path / "evil_pkg_ran"
    (tmp_path / "evil_pkg").mkdir()
    (tmp_path / "evil_pkg" / "__init__.py").write_text(
        f"import torch\n\nopen({str(marker)!r}, 'w').close()  # importing this module is running its code\n\n"
        "class Model(torch.nn.Module):\n    pass\n")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "evil_pkg.Model"}))
    return folder, marker


def test_cli_adapter_derive_imports_no_class_outside_diffusers_without_trust_remote_code(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.tools.cli import main

    folder, marker = _folder_naming_a_shipped_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["adapter", "derive", str(folder)]) == 2
    assert (marker.exists(), "evil_pkg" in sys.modules) == (False, False)
    assert capsys.readouterr().err == (
        f"hookkit adapter: error: adapter derive: expected a class diffusers ships as the _class_name of "
        f"'{folder / 'config.json'}', got 'evil_pkg.Model': reading it would import the module 'evil_pkg' and run its "
        "code; nothing was imported. If you trust that code, pass --trust-remote-code (in Python: "
        "transformer_class(..., trust_remote_code=True)).\n")


def test_a_diffusers_class_is_resolved_by_its_name_on_diffusers() -> None:
    from hookkit.adapters.derive import transformer_class

    path = "diffusers.models.transformers.transformer_flux.FluxTransformer2DModel"
    assert transformer_class(path) is transformer_class("FluxTransformer2DModel") is FluxTransformer2DModel
    with pytest.raises(AdapterError, match=r"got 'diffusers.models.FluxTransformer2DModelX', which names no class"):
        transformer_class("diffusers.models.FluxTransformer2DModelX")


def test_trust_remote_code_imports_the_class_a_model_folder_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hookkit.adapters.derive import transformer_class

    _, marker = _folder_naming_a_shipped_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        cls = transformer_class("evil_pkg.Model", trust_remote_code=True)
    finally:
        imported = sys.modules.pop("evil_pkg", None)
    assert cls is imported.Model
    assert marker.exists()  # the marker does record an import: its absence above means nothing was imported


@pytest.mark.parametrize(("text", "problem"), [
    ("{not json", "got JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)."),
    ('{"_class_name": 5}', None),
])
def test_cli_adapter_derive_refuses_a_config_json_it_cannot_read(text: str, problem: str | None, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from hookkit.tools.cli import main

    (tmp_path / "config.json").write_text(text)
    assert main(["adapter", "derive", str(tmp_path)]) == 2
    config = tmp_path / "config.json"
    expected = (f"expected '{config}' to be a readable JSON file (a diffusers config.json), {problem}" if problem else
                f"expected the _class_name of '{config}' to be a class name, got 5.")
    assert capsys.readouterr().err == f"hookkit adapter: error: adapter derive: {expected}\n"


# --- confirmed at the first call ---------------------------------------------------------------------------


def _call_once(transformer, handle, config: str):
    from diffusers_configs import inputs

    with handle.generation(num_steps=1), torch.no_grad():
        return transformer(**inputs(config), return_dict=False)


def test_block_lists_out_of_execution_order_are_refused_at_the_first_call() -> None:
    transformer = _tiny("FluxTransformer")
    flux = hookkit.get_adapter("flux")
    reversed_lists = attrs.evolve(flux, name="flux-reversed", blocks=tuple(reversed(flux.blocks)))
    handle = hookkit.enable(transformer, hookkit.Spec(), adapter=reversed_lists)
    with pytest.raises(AdapterError, match=r"expected the blocks to run in the order of its \[\[blocks\]\] tables "
                                           r"\['single_transformer_blocks', 'transformer_blocks'\].*Write the "
                                           r"\[\[blocks\]\] tables in the order they run: \['transformer_blocks', "
                                           r"'single_transformer_blocks'\]"):
        _call_once(transformer, handle, "FluxTransformer")
    assert handle.summary().first_call == "pending"
    assert all(not registry_names(b) for b in transformer.transformer_blocks)  # observers gone after the raise


def test_a_return_order_the_code_contradicts_is_refused_at_the_first_call_with_the_toml_to_write() -> None:
    transformer = _tiny("BriaTransformer")
    derived = derive_adapter(transformer)
    wrong = attrs.evolve(derived, name="bria-as-registered", blocks=(
        attrs.evolve(derived.blocks[0], encoder_arg=None, returns=("hidden_states",)), derived.blocks[1]))
    handle = hookkit.enable(transformer, hookkit.Spec(), adapter=wrong)
    with pytest.raises(AdapterError, match=r"transformer_blocks.0 \(BriaTransformerBlock\): expected the block to return "
                                           r"\('hidden_states',\) .* got tuple\(Tensor.*Describe what it returns"):
        _call_once(transformer, handle, "BriaTransformer")


def test_a_stream_that_changes_shape_between_lists_is_refused_with_the_lists_to_leave_out() -> None:
    transformer = _tiny("Flux2Transformer")
    both = hookkit.AdapterSpec(name="flux2-both", transformer=("Flux2Transformer2DModel",), blocks=(
        hookkit.BlockListSpec(attr="transformer_blocks", classes=("Flux2TransformerBlock",),
                              encoder_arg="encoder_hidden_states", returns=("encoder_hidden_states", "hidden_states")),
        hookkit.BlockListSpec(attr="single_transformer_blocks", classes=("Flux2SingleTransformerBlock",)),
    ), diffusers_metadata="ignore")
    handle = hookkit.enable(transformer, hookkit.Spec(), adapter=both)
    with pytest.raises(AdapterError, match=r"expected the hidden stream to keep its shape from transformer_blocks.0 to "
                                           r"single_transformer_blocks.0 .*Move \['transformer_blocks'\] from "
                                           r"\[\[blocks\]\] to \[left_out\]"):
        _call_once(transformer, handle, "Flux2Transformer")


def test_once_confirmed_no_observer_is_left_on_any_block() -> None:
    transformer = _tiny("ZImageTransformer")
    handle = hookkit.enable(transformer, hookkit.Spec())
    _call_once(transformer, handle, "ZImageTransformer")
    assert handle.summary().first_call == "confirmed"
    assert all("forward" not in vars(m) for m in transformer.layers)


def test_schema_extensions_are_validated_with_the_field_named(tmp_path: Path) -> None:
    base = 'name = "x"\ntransformer = ["X"]\n[[blocks]]\nattr = "b"\nclass = "B"\n'
    cases = {
        base + 'long_skips = "yes"\n': r"\.blocks\[b\]\.long_skips: expected true or false, got 'yes'",
        'diffusers_metadata = "maybe"\n' + base: r"\.diffusers_metadata: expected one of \('check', 'ignore'\)",
        base + '[left_out]\nb = "listed twice"\n': r"\.left_out: expected only lists that are not \[\[blocks\]\], got \['b'\]",
    }
    for i, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"x{i}.toml"
        path.write_text(text)
        with pytest.raises(AdapterError, match=message):
            hookkit.AdapterSpec.from_toml(path)



# --- context-parallel plans ([[cp_plan]]) -------------------------------------------------------------------------

_SKY_CP_TOML = '''
[[cp_plan]]
module = "rope"
split = [{ output = 0, split_dim = 1, expected_dims = 4 }, { output = 1, split_dim = 1, expected_dims = 4 }]

[[cp_plan]]
module = "blocks.0"
split = [{ input = "hidden_states", split_dim = 1, expected_dims = 3 }]

[[cp_plan]]
module = "proj_out"
gather = [{ gather_dim = 1, expected_dims = 3 }]
'''


def _sky_dict(cp_plan: Any) -> dict[str, Any]:
    return {"name": "sky", "transformer": ["SkyReelsV2Transformer3DModel"],
            "blocks": [{"attr": "blocks", "class": "SkyReelsV2TransformerBlock"}], "cp_plan": cp_plan}


def test_a_cp_plan_reads_into_diffusers_vocabulary() -> None:
    import tomllib

    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    adapter = hookkit.AdapterSpec.from_dict(_sky_dict(tomllib.loads(_SKY_CP_TOML)["cp_plan"]))
    assert adapter.diffusers_cp_plan() == {
        "rope": {0: ContextParallelInput(split_dim=1, expected_dims=4, split_output=True),
                 1: ContextParallelInput(split_dim=1, expected_dims=4, split_output=True)},
        "blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }
    assert hookkit.get_adapter("skyreelsv2").cp_plan == adapter.cp_plan  # the shipped file says the same
    assert hookkit.get_adapter("flux").diffusers_cp_plan() is None


def test_a_cp_plan_survives_adapter_toml() -> None:
    import tomllib

    from hookkit.adapters import adapter_toml

    shipped = hookkit.get_adapter("skyreelsv2")
    again = hookkit.AdapterSpec.from_dict(tomllib.loads(adapter_toml(shipped)))
    assert (again.cp_plan, again.cp_plan_override) == (shipped.cp_plan, False)


_GATHER = {"module": "proj_out", "gather": [{"gather_dim": 1, "expected_dims": 3}]}
_SPLIT = {"input": "hidden_states", "split_dim": 1}


@pytest.mark.parametrize("plan, message", [
    ([{"module": "blocks.0", "split": [{"input": "hidden_states", "split_dim": "1"}]}, _GATHER],
     r"cp_plan\['blocks.0'\].split\[0\].split_dim: expected an int \(the sequence dimension of the tensor\), got '1'"),
    ([{"module": "rope", "split": [{"input": "x", "output": 0, "split_dim": 1}]}, _GATHER],
     r"cp_plan\['rope'\].split\[0\]: expected exactly one of `input` \(a forward argument name\) and `output`"),
    ([{"module": "blocks.0", "split": [{"input": 3, "split_dim": 1}]}, _GATHER],
     r"split\[0\].input: expected the name of a forward argument \(a string\), got 3"),
    ([{"module": "blocks.0", "split": [{"input": "hidden_states", "split_dim": 3, "expected_dims": 3}]}, _GATHER],
     r"split\[0\].split_dim: expected a dim of a 3-dim tensor \(-3 .. 2\), got 3. Fix the dim or expected_dims."),
    ([{"module": "blocks.0", "split": [_SPLIT]}, {"module": "proj_out", "gather": [{"dim": 1}]}],
     r"cp_plan\['proj_out'\].gather\[0\].dim: expected one of \['expected_dims', 'gather_dim'\], got 1"),
    ([{"module": "blocks.0", "split": [{"input": "hidden_states"}]}, _GATHER],
     r"cp_plan\['blocks.0'\].split\[0\].split_dim: expected to be present \(the sequence dimension\), got None. "
     r"Add split_dim = ..."),
    ([{"module": "blocks.0", "split": [_SPLIT], "gather": [{"gather_dim": 1}]}],
     r"cp_plan\['blocks.0'\]: expected either `split` or `gather` \(not both, not neither\)"),
    ([{"module": "blocks.0", "split": [_SPLIT]}],
     r"cp_plan: expected a table that gathers the sequence back \(`gather`\)"),
    ([{"split": [_SPLIT]}, _GATHER], r"cp_plan: expected 'module' in every \[\[cp_plan\]\] table"),
    ([{"module": "blocks..0", "split": [_SPLIT]}, _GATHER],
     r"cp_plan.module: expected a module path under the transformer"),
    ([{"module": "blocks.0", "split": [_SPLIT, _SPLIT]}, _GATHER],
     r"cp_plan\['blocks.0'\].split: expected each input name or output index once"),
])
def test_a_bad_cp_plan_field_is_named_when_the_adapter_loads(plan: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(AdapterError, match=message):
        hookkit.AdapterSpec.from_dict(_sky_dict(plan), source="sky.toml")


def test_cp_plan_override_needs_a_plan() -> None:
    with pytest.raises(AdapterError, match=r"cp_plan_override: expected a \[\[cp_plan\]\] to override with"):
        hookkit.AdapterSpec.from_dict({**_sky_dict([]), "cp_plan_override": True})


@pytest.mark.parametrize("entry, message", [
    ({"module": "blocks.9", "split": [{"input": "hidden_states", "split_dim": 1}]},
     r"cp_plan.module: expected a module path under SkyReelsV2Transformer3DModel, got 'blocks.9'. "
     r"ModuleList has no submodule '9'"),
    ({"module": "blocks.*", "split": [{"input": "hidden", "split_dim": 1}]},
     r"cp_plan\['blocks.\*'\].split\[0\].input: expected an argument of SkyReelsV2TransformerBlock.forward "
     r"\['hidden_states', 'encoder_hidden_states', 'temb', 'rotary_emb', 'attention_mask'\], got 'hidden'"),
])
def test_a_cp_plan_is_checked_against_the_model_when_matched(entry: dict[str, Any], message: str) -> None:
    from diffusers_configs import build

    adapter = hookkit.AdapterSpec.from_dict(_sky_dict([entry, _GATHER]))
    with pytest.raises(AdapterError, match=message):
        adapter.check(build("SkyReelsV2Transformer"))
