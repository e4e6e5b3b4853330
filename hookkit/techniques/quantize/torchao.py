"""torchao weight quantization of a transformer's Linear layers, chosen by the adapter and explicit rules.

`select_layers` decides for every `nn.Linear`, with one reason per skipped layer, in this order: facts
nothing overrides ("already quantized", "LoRA adapter"); the selection rules, which `Quantize.include`
overrides and `Quantize.filter_fn` replaces ("outside the repeated blocks", "excluded by name" from the
adapter's `quant_exclude`, its `quant_modulation` unless `Quantize.include_modulation`, and `Quantize.exclude`,
"too small"); the scheme's requirements, which nothing overrides because torchao would silently skip the layer
(divisibility, weight dtype). Patterns are fnmatch'ed on the module path with PEFT's trailing `.base_layer` removed;
a `Quantize.exclude` or `include` pattern that matches no Linear is refused (`SpecError`, with the closest paths).

Quantization happens once, at attach; `build_plan` lists one attachment per chosen layer without touching it.
Before torchao is called, every chosen layer's device is checked against the scheme (`UnsupportedError`);
a spec that chooses no layer is refused (`SpecError`, counting the reasons); torchao's global inductor
settings are never changed. Removal puts the originals back when `keep_original` kept them ("cpu" or
"device"); without them `handle.remove()` refuses before removing anything. fp8 needs `torch.compile` to pay
off (each dynamic activation quantization is its own kernel in eager mode): see BENCHMARKS.md.

    handle = hookkit.enable(pipe, hookkit.Spec(quantize=hookkit.Quantize(scheme="fp8_row", keep_original="cpu")))
    print(handle.summary())      # every Linear: quantized, or skipped and why
    hookkit.disable(pipe)        # puts the original weights back
"""

from __future__ import annotations

import difflib
import fnmatch
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch
from loguru import logger

from hookkit.adapters import AdapterSpec, resolve_adapter
from hookkit.core.feature import AttachContext, BaseFeature
from hookkit.core.plan import Attachment, PlanContext, module_at
from hookkit.core.quiet import quiet_imports
from hookkit.core.removal import Removal
from hookkit.core.summary import FeatureSummary, path_template, render_indices, table
from hookkit.errors import EnableError, HookError, SpecError, UnsupportedError, field_error
from hookkit.techniques.quantize.filters import Predicate
from hookkit.techniques.quantize.spec import QUANT_SCHEMES, Quantize

NAME = "quantize"
QUANTIZE_HOOK = "hookkit.quantize"
GUARD = "hookkit.quantize.guard"

# Reasons a Linear is skipped: stable strings, part of the report's data.
EXCLUDED = "excluded by name"
OUTSIDE = "outside the repeated blocks"
TOO_SMALL = "too small"
REJECTED = "rejected by filter_fn"
ALREADY_QUANTIZED = "already quantized"
LORA = "LoRA adapter"

#: PEFT's LoRA layers: `<path>.base_layer` is the wrapped Linear, `<path>.lora_A.<adapter>` and
#: `<path>.lora_B.<adapter>` the low-rank update
_PEFT_BASE = ".base_layer"
_LORA_NAMES = frozenset({"lora_A", "lora_B"})


def not_divisible(n: int) -> str:
    return f"not divisible by {n}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def wrong_dtype(expected: tuple[torch.dtype, ...]) -> str:
    """The reason of a layer whose weight dtype is not one of `expected`, e.g. "dtype not bfloat16 or float32"."""
    return "dtype not " + " or ".join(_dtype_name(d) for d in expected)


# --- schemes ---------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SchemeInfo:
    """What a scheme needs from a layer and from the device."""

    name: str
    description: str
    #: `in_features` and `out_features` must be multiples of this (1: no rule)
    divisor: int = 1
    #: the weights must have one of these dtypes (empty: any floating dtype)
    weight_dtypes: tuple[torch.dtype, ...] = ()
    #: minimal CUDA compute capability (None: runs on any device, the CPU included)
    capability: tuple[int, int] | None = None


SCHEMES: dict[str, SchemeInfo] = {
    "fp8_row": SchemeInfo(name="fp8_row", divisor=16, weight_dtypes=(torch.bfloat16,), capability=(8, 9),
                          description="float8 e4m3 weights and dynamic activations, per-row scales"),
    "fp8_tensor": SchemeInfo(name="fp8_tensor", divisor=16, capability=(8, 9),
                             description="float8 e4m3 weights and dynamic activations, per-tensor scales"),
    "fp8_weight_only": SchemeInfo(name="fp8_weight_only",
                                  description="float8 e4m3 weights (per-row), dequantized in the matmul: saves memory, not time"),
    "int8_dynamic": SchemeInfo(name="int8_dynamic", description="int8 per-row weights and dynamic per-token activations"),
    "int8_weight_only": SchemeInfo(name="int8_weight_only", description="int8 per-row weights"),
    # torchao's NVFP4 and MX tensors take bf16 or fp32; the MX *config* handler asserts bf16 on top of that.
    "nvfp4": SchemeInfo(name="nvfp4", divisor=16, weight_dtypes=(torch.bfloat16, torch.float32), capability=(10, 0),
                        description="NVFP4 weights and dynamic activations (fp4 e2m1, fp8 block scales of 16)"),
    "mxfp8": SchemeInfo(name="mxfp8", divisor=32, weight_dtypes=(torch.bfloat16,), capability=(10, 0),
                        description="MX float8 e4m3 weights and dynamic activations (e8m0 block scales of 32)"),
}
if tuple(SCHEMES) != QUANT_SCHEMES:  # specs.py validates the names, this table implements them
    raise ImportError(f"hookkit.techniques.quantize.torchao.SCHEMES {tuple(SCHEMES)} != hookkit.techniques.quantize.spec.QUANT_SCHEMES {QUANT_SCHEMES}")

_GPUS = {(8, 9): "Ada, Hopper or Blackwell, e.g. L4, L40S, H100, H200, B200",
         (10, 0): "Blackwell, e.g. B200, GB200, RTX PRO 6000"}


#: the smallest activation amax torchao's dynamic fp8 quantization scales by (`activation_value_lb`). Why: without it
#: an all-zero row (or tensor) gets the scale 0 and quantizes to 0 / 0 = NaN, and the Linear's output row is NaN
#: (torchao 0.17, eager and compiled). Zero rows are real: attention under a padding mask gives its fully masked
#: queries 0 (SDPA's and hookkit's kernels), and HunyuanVideo 1.5's output projection then turned the whole video
#: non-finite (BENCHMARKS.md). With the floor a zero row quantizes to zeros, as bf16 computes it. 2**-14: exact in
#: bf16 and fp16, and its scale (2**-14 / 448, taken in the input's dtype) is not 0 in fp16 either; only rows whose
#: largest value is below it (about 6e-5) are scaled differently, still finely. `compile.fp8_rows.AMAX_FLOOR` is the
#: same value (its fused kernels match it).
ACTIVATION_AMAX_FLOOR = 2.0 ** -14


def make_config(scheme: str) -> Any:
    """The torchao config of `scheme`, never allowed to change global inductor settings.

    hookkit's first import of torchao is here: inside `quiet_imports`, so that its import-time chatter (kernels a CPU
    build cannot load, torch's pytree deprecations) is not printed on the user's behalf."""
    if scheme not in SCHEMES:
        raise SpecError(f"Quantize.scheme: expected one of {QUANT_SCHEMES}, got {scheme!r}.")
    try:
        with quiet_imports():
            from torchao.quantization import (
                Float8DynamicActivationFloat8WeightConfig,
                Float8WeightOnlyConfig,
                Int8DynamicActivationInt8WeightConfig,
                Int8WeightOnlyConfig,
                PerRow,
                PerTensor,
            )
    except ImportError as exc:
        raise UnsupportedError(f"Quantize(scheme={scheme!r}) needs torchao: pip install 'torchao>=0.17' ({exc}).") from None
    if scheme in ("fp8_row", "fp8_tensor"):
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow() if scheme == "fp8_row" else PerTensor(),
                                                         activation_value_lb=ACTIVATION_AMAX_FLOOR,
                                                         set_inductor_config=False)
    if scheme == "fp8_weight_only":
        return Float8WeightOnlyConfig(set_inductor_config=False)
    # version=2 (Int8Tensor): the default of torchao 0.18, opt-in on 0.17 where version 1 is deprecated.
    if scheme == "int8_dynamic":
        return Int8DynamicActivationInt8WeightConfig(version=2, set_inductor_config=False)
    if scheme == "int8_weight_only":
        return Int8WeightOnlyConfig(version=2, set_inductor_config=False)
    # The MX configs have no set_inductor_config field: their handlers leave inductor alone.
    try:
        with quiet_imports():
            from torchao.prototype.mx_formats import (
                MXDynamicActivationMXWeightConfig,
                NVFP4DynamicActivationNVFP4WeightConfig,
            )
    except ImportError as exc:
        raise UnsupportedError(
            f"Quantize.scheme={scheme!r}: expected a torchao with the prototype MX formats "
            f"(torchao.prototype.mx_formats), got one without them ({exc}). Install one that has them "
            "(pip install 'torchao>=0.17') or choose scheme='fp8_row'."
        ) from None

    if scheme == "nvfp4":
        return NVFP4DynamicActivationNVFP4WeightConfig()
    return MXDynamicActivationMXWeightConfig(block_size=32, activation_dtype=torch.float8_e4m3fn,
                                             weight_dtype=torch.float8_e4m3fn)


# --- hardware --------------------------------------------------------------------------------------------


def unsupported_reason(scheme: str, device: torch.device, capability: tuple[int, int] | None = None,
                       device_name: str = "") -> str | None:
    """Why `scheme` cannot run on `device` (with CUDA `capability`), with what to use instead; None if it can.

    Pure: it queries nothing, so that the rules are testable without the hardware.
    """
    need = SCHEMES[scheme].capability
    if need is None:
        return None
    if device.type == "cuda" and capability is not None and tuple(capability) >= need:
        return None
    head = (f"Quantize.scheme={scheme!r} needs an NVIDIA GPU with compute capability {need[0]}.{need[1]} or newer "
            f"({_GPUS[need]})")
    if device.type != "cuda":
        found = f"the transformer's Linear weights are on {device.type!r}"
        instead = ("On this device use scheme='int8_weight_only' or 'int8_dynamic' (or 'fp8_weight_only', which "
                   "stores fp8 weights to save memory but computes in the original dtype), or move the transformer "
                   "to such a GPU before hookkit.enable.")
    else:
        cc = f"{capability[0]}.{capability[1]}" if capability is not None else "unknown"
        found = f"{device} is {device_name or 'a CUDA device'} with compute capability {cc}"
        if capability is not None and tuple(capability) >= (8, 9):
            instead = "This GPU runs scheme='fp8_row' (or 'fp8_tensor'): use that instead."
        else:
            instead = ("On this GPU use scheme='int8_dynamic' or 'int8_weight_only' (or 'fp8_weight_only' to save "
                       "memory only).")
    return f"{head}; {found}. Nothing was quantized. {instead}"


def check_hardware(scheme: str, devices: Iterable[torch.device]) -> None:
    """Raise `UnsupportedError` unless every device in `devices` runs `scheme`."""
    for device in sorted(set(devices), key=str):
        capability, name = None, ""
        if device.type == "cuda" and torch.cuda.is_available():
            capability = torch.cuda.get_device_capability(device)
            name = torch.cuda.get_device_name(device)
        reason = unsupported_reason(scheme, device, capability, name)
        if reason is not None:
            raise UnsupportedError(reason)


# --- selection -------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class LayerDecision:
    """One Linear of the transformer: quantized, or skipped with a `reason` (and a `detail` saying which rule)."""

    path: str
    in_features: int
    out_features: int
    dtype: str
    quantized: bool
    reason: str = ""
    detail: str = ""


@attrs.frozen(kw_only=True)
class QuantizeReport:
    """Every Linear of the transformer with its decision, in module order."""

    scheme: str
    region: tuple[str, ...]  # repeated block classes, or () for region="all"
    layers: tuple[LayerDecision, ...]

    @property
    def chosen(self) -> tuple[LayerDecision, ...]:
        return tuple(d for d in self.layers if d.quantized)

    @property
    def skipped(self) -> tuple[LayerDecision, ...]:
        return tuple(d for d in self.layers if not d.quantized)

    def reasons(self) -> dict[str, str]:
        """`{path: reason}` of every skipped layer."""
        return {d.path: d.reason for d in self.layers if not d.quantized}

    def counts(self) -> dict[str, int]:
        """Skipped layers per reason."""
        out: dict[str, int] = {}
        for d in self.skipped:
            out[d.reason] = out.get(d.reason, 0) + 1
        return out

    def to_data(self) -> dict[str, Any]:
        return {
            "scheme": self.scheme,
            "region": list(self.region) if self.region else "all",
            "counts": {self.scheme: len(self.chosen)},
            "quantized": len(self.chosen),
            "skipped": len(self.skipped),
            "total": len(self.layers),
            "skipped_by_reason": self.counts(),
            "layers": [attrs.asdict(d) for d in self.layers],
        }

    def render(self, layers: bool = True) -> str:
        """cache-dit's "Quantized Region" block: totals, then (`layers`) the layers grouped by block index."""
        region = ", ".join(self.region) + " (repeated blocks)" if self.region else "all Linear layers"
        head = f"Quantized region: {region}\n" + table(
            ["scheme", "quantized", "skipped", "Linear layers"],
            [[self.scheme, len(self.chosen), len(self.skipped), len(self.layers)]],
        )
        if not layers:
            return head + "\neach layer, quantized or skipped and why: the full summary"
        groups: dict[tuple[str, bool, str], list[LayerDecision]] = {}
        for d in self.layers:
            groups.setdefault((path_template(d.path)[0], d.quantized, d.reason), []).append(d)
        rows = []
        for (template, quantized, reason), members in groups.items():
            shapes = {(d.in_features, d.out_features) for d in members}
            shape = f"{members[0].in_features} -> {members[0].out_features}" if len(shapes) == 1 else "mixed"
            indices = [i for d in members if (i := path_template(d.path)[1]) is not None]
            rows.append([render_indices(template, indices) if indices else template, len(members), shape,
                         "quantized" if quantized else "skipped", reason])
        return head + "\n\n" + table(["layers", "count", "in -> out", "status", "reason"], rows)


def _first_match(path: str, patterns: tuple[str, ...]) -> str | None:
    return next((p for p in patterns if fnmatch.fnmatchcase(path, p)), None)


def pattern_path(path: str) -> str:
    """The path name patterns match: a PEFT-wrapped Linear lives at `<path>.base_layer`, and is the layer at `<path>`."""
    return path.removesuffix(_PEFT_BASE)


def _is_plain(weight: torch.Tensor) -> bool:
    """True for a weight torchao can quantize: exactly a Parameter or Tensor. torchao's quantized tensors (and
    bitsandbytes' or GGUF's) are subclasses, and a subclass is never exactly one of these."""
    return type(weight) in (torch.nn.Parameter, torch.Tensor)


def _as_pattern(path: str) -> str:
    """`single_transformer_blocks.3.proj_out` -> `single_transformer_blocks.*.proj_out`: a path as a pattern."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def _check_patterns(transformer: torch.nn.Module, spec: Quantize) -> None:
    """Refuse an `exclude` or `include` pattern that matches no Linear layer: a typo there would quietly quantize the
    layers meant to stay in full precision (or leave out those meant in), so it is an error before anything changes."""
    names = [pattern_path(path) for path, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    for field, patterns in (("exclude", spec.exclude), ("include", spec.include)):
        for pattern in patterns:
            if any(fnmatch.fnmatchcase(name, pattern) for name in names):
                continue
            shapes = sorted(set(map(_as_pattern, names)))
            candidates = shapes
            if pattern.startswith("*."):  # compare like with like: "*.norm1.linaer" with the paths' last two parts
                tail = pattern.count(".")
                candidates = sorted({"*." + ".".join(shape.split(".")[-tail:]) for shape in shapes
                                     if shape.count(".") >= tail})
            close = difflib.get_close_matches(pattern, candidates, n=3, cutoff=0.6)
            hint = (f"the closest: {', '.join(map(repr, close))}" if close else
                    f"they look like {shapes[0]!r}" if shapes else "it has none")
            raise field_error(
                "Quantize", field, pattern,
                f"fnmatch patterns that each match the module path of a Linear layer of {type(transformer).__name__}",
                f"It matches none of its {len(names)} Linear layers ({hint}). Fix or remove the pattern; nothing was "
                "quantized.")


def select_layers(transformer: torch.nn.Module, spec: Quantize, adapter: AdapterSpec | None = None) -> QuantizeReport:
    """Decide for every Linear of `transformer` whether `spec` quantizes it, and why not. Reads only."""
    if not isinstance(spec, Quantize):
        raise SpecError(f"select_layers.spec: expected a hookkit.Quantize, got {type(spec).__name__} {spec!r}. "
                        "Pass one, e.g. select_layers(transformer, hookkit.Quantize(scheme='int8_weight_only')).")
    adapter = adapter if adapter is not None else resolve_adapter(transformer)
    _check_patterns(transformer, spec)
    info = SCHEMES[spec.scheme]
    classes, prefixes = adapter.repeated_block_classes(), adapter.repeated_block_paths(transformer)
    region_on = spec.region == "repeated_blocks"
    decisions = []
    for path, module in transformer.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = module.weight
        name = pattern_path(path)
        lora = _LORA_NAMES.intersection(path.split("."))
        ok, reason, detail = True, "", ""
        if not _is_plain(weight):
            ok, reason, detail = False, ALREADY_QUANTIZED, f"weight is a {type(weight).__name__}, not a plain Parameter"
        elif lora:
            ok, reason, detail = False, LORA, f"PEFT {min(lora)}: only the base_layer it wraps is quantized"
        elif spec.filter_fn is not None:
            if not spec.filter_fn(module, path):
                ok, reason, detail = False, REJECTED, f"Quantize.filter_fn={spec.filter_fn!r}"
        elif _first_match(name, spec.include) is None:
            adapter_pattern = _first_match(name, adapter.quant_exclude)
            modulation_pattern = None if spec.include_modulation else _first_match(name, adapter.quant_modulation)
            spec_pattern = _first_match(name, spec.exclude)
            if region_on and not any(path.startswith(p + ".") for p in prefixes):
                ok, reason, detail = False, OUTSIDE, f"not inside {', '.join(classes)}"
            elif adapter_pattern is not None:
                ok, reason, detail = False, EXCLUDED, f"adapter {adapter.name!r} quant_exclude {adapter_pattern!r}"
            elif modulation_pattern is not None:
                ok, reason = False, EXCLUDED
                detail = (f"adapter {adapter.name!r} quant_modulation {modulation_pattern!r} "
                          "(Quantize(include_modulation=True) quantizes it)")
            elif spec_pattern is not None:
                ok, reason, detail = False, EXCLUDED, f"Quantize.exclude {spec_pattern!r}"
            elif min(module.in_features, module.out_features) < spec.min_features:
                ok, reason = False, TOO_SMALL
                detail = f"min(in, out) = {min(module.in_features, module.out_features)} < min_features={spec.min_features}"
        if ok and (module.in_features % info.divisor or module.out_features % info.divisor):
            ok, reason = False, not_divisible(info.divisor)
            detail = f"in_features={module.in_features}, out_features={module.out_features}"
        if ok and info.weight_dtypes and weight.dtype not in info.weight_dtypes:
            ok, reason = False, wrong_dtype(info.weight_dtypes)
            detail = f"{spec.scheme} needs {' or '.join(map(str, info.weight_dtypes))} weights, has {weight.dtype}"
        decisions.append(LayerDecision(path=path, in_features=module.in_features, out_features=module.out_features,
                                       dtype=_dtype_name(weight.dtype), quantized=ok, reason=reason, detail=detail))
    return QuantizeReport(scheme=spec.scheme, region=classes if region_on else (), layers=tuple(decisions))


def layer_filter(transformer: torch.nn.Module, spec: Quantize, adapter: AdapterSpec | None = None) -> Predicate:
    """The selection of `spec` on `transformer` as a torchao `filter_fn(module, fqn)`: use it with
    `torchao.quantization.quantize_(transformer, config, filter_fn=...)` directly if you like."""
    chosen = frozenset(d.path for d in select_layers(transformer, spec, adapter).chosen)
    return Predicate(lambda module, fqn: fqn in chosen, f"hookkit.layer_filter({spec.scheme}: {len(chosen)} layers)")


# --- quantizing one layer --------------------------------------------------------------------------------


def _root_only(module: torch.nn.Module, fqn: str) -> bool:
    return fqn == ""


class QuantizedLayer(Removal):
    """One Linear whose weight torchao replaced. `remove()` puts the original back when it was kept.

    If torchao fails, or leaves the weight a plain tensor (it skips layers it cannot take, yet still installs
    a new Parameter with requires_grad=False and its extra_repr), the layer is put back exactly as it was and
    the constructor raises: a layer counted as quantized must be quantized.
    """

    def __init__(self, module: torch.nn.Linear, path: str, config: Any, keep_original: str | None,
                 model: torch.nn.Module | None = None) -> None:
        from torchao.quantization import quantize_

        self.path = path
        #: the model the layer is in: restoring follows its current dtype and device (see `_placement`)
        self._model = model
        self.keep_original = keep_original
        self._module: torch.nn.Linear | None = module
        before = dict(module.__dict__)
        weight = module.weight
        self._bias = module.bias
        self._device = weight.device
        self._requires_grad = weight.requires_grad
        self._weight: torch.Tensor | None = None
        if keep_original == "device" or (keep_original == "cpu" and weight.device.type == "cpu"):
            self._weight = weight  # the Parameter itself: restored as the very same object
        elif keep_original == "cpu":
            self._weight = weight.detach().to("cpu", copy=True)
        try:
            quantize_(module, config, filter_fn=_root_only)
        except BaseException:
            self._note_changes(module, before)
            self._restore(module, weight)  # the original Parameter is at hand here, kept or not
            raise
        self._note_changes(module, before)
        if _is_plain(module.weight):
            got = type(module.weight).__name__
            self._restore(module, weight)
            raise HookError(
                f"{path}: expected torchao ({type(config).__name__}) to replace the weight {tuple(weight.shape)} "
                f"{weight.dtype} with a quantized tensor, got a plain {got}: torchao skipped the layer for a "
                "requirement hookkit's layer rules missed. The layer was restored as it was. Exclude it "
                f"(hookkit.Quantize(exclude=({pattern_path(path)!r},))) and report this to hookkit."
            )

    def _note_changes(self, module: torch.nn.Linear, before: dict[str, Any]) -> None:
        """What torchao put into the instance dict (its extra_repr), to be undone exactly on removal."""
        self._added = [k for k in module.__dict__ if k not in before]
        self._replaced = {k: v for k, v in before.items() if module.__dict__.get(k) is not v}

    def _restore(self, module: torch.nn.Linear, weight: torch.nn.Parameter) -> None:
        """Put `weight` and the bias back and undo torchao's instance-dict changes; the layer is done with."""
        self._module = None
        module._parameters["weight"] = weight
        if module._parameters.get("bias") is not self._bias:
            module._parameters["bias"] = self._bias
        for key in self._added:
            module.__dict__.pop(key, None)
        module.__dict__.update(self._replaced)
        self._weight = self._bias = None

    def _placement(self, module: torch.nn.Linear) -> tuple[torch.device, torch.dtype | None]:
        """Where the original weight goes back: the model's current device and dtype, which `pipe.to(...)` may have
        changed since enable (torchao's tensors do not follow a dtype cast, the layer's bias and the other layers
        do). Read from the layer's bias, else the model's first unquantized floating parameter."""
        quantized = module.weight
        candidates = [module.bias] if module.bias is not None else []
        if self._model is not None:
            candidates += [p for p in self._model.parameters() if _is_plain(p) and p.is_floating_point()][:1]
        for tensor in candidates:
            if _is_plain(tensor) and tensor.is_floating_point():
                return tensor.device, tensor.dtype
        return quantized.device, None

    def _undo(self) -> None:
        module = self._module
        if module is None:  # already restored (the constructor's failure path)
            return
        if self._weight is None:
            self._module = None
            logger.debug("{} stays quantized (keep_original=None)", self.path)
            return
        weight = self._weight
        device, dtype = self._placement(module)
        if not isinstance(weight, torch.nn.Parameter) or weight.device != device or (dtype and weight.dtype != dtype):
            moved = weight.detach().to(device=device, dtype=dtype or weight.dtype)
            weight = torch.nn.Parameter(moved, requires_grad=self._requires_grad)
        self._restore(module, weight)


class QuantizedGuard(Removal):
    """Refuses, before anything is touched, what fails midway on a model with torchao weights:

    - `load_state_dict` with a key of a quantized weight (torchao cannot take a plain tensor into its tensors: the
      load would stop midway, and `disable` would then restore the enable-time originals into a model half new).
      A load pre-hook on the transformer and on every module above a quantized layer checks the keys first;
      a state dict without such keys (a LoRA adapter's) loads as stock;
    - `save_pretrained` of the transformer or of the pipeline (it would write torchao tensors without a
      quantization config, or fail midway and leave a half-written folder): patched on the instances;
    - `fuse_lora` of the transformer, or of the pipeline with the transformer among its components, while a LoRA
      layer wraps a quantized Linear (peft cannot add a LoRA into torchao's tensors: the merge fails after diffusers
      has scaled every LoRA layer by `lora_scale`, and that scale stays): patched on the instances.
    """

    def __init__(self, transformer: torch.nn.Module, paths: list[str], pipeline: Any | None = None,
                 joins: QuantizedGuard | None = None) -> None:
        self._removals: list[Any] = []
        #: the guards of the pipeline's other quantized transformers (Wan 2.2's `transformer_2`), which join this one's
        #: pipeline patches: a pipeline method can be patched once, and it must refuse for every transformer
        self.partners: list[QuantizedGuard] = []
        self._joined = joins
        self.count = len(paths)
        self._class = type(transformer).__name__
        self._transformer = transformer
        #: the quantized Linears by identity: PEFT wraps one in a LoRA layer as its `base_layer` (before or after enable)
        self._quantized = {id(module_at(transformer, path)): path for path in paths}
        try:
            keys_under: dict[str, list[str]] = {}
            for path in paths:
                parts = path.split(".")
                for i in range(len(parts) + 1):
                    rest = ".".join(parts[i:])
                    keys_under.setdefault(".".join(parts[:i]), []).extend(
                        (f"{rest}.weight", f"{rest}{_PEFT_BASE}.weight") if rest else ("weight",))
            for where, keys in keys_under.items():
                module = module_at(transformer, where)
                self._removals.append(module.register_load_state_dict_pre_hook(self._load_check(tuple(keys))))
            from hookkit.core.methods import MethodPatch

            for owner in (transformer, pipeline):
                if owner is not None and callable(getattr(owner, "save_pretrained", None)):
                    self._removals.append(MethodPatch(owner, "save_pretrained",
                                                      self._refuse_save(type(owner).__name__, owner is pipeline)))
            if callable(getattr(transformer, "fuse_lora", None)):
                self._removals.append(MethodPatch(transformer, "fuse_lora", self._check_fuse(None)))
            if pipeline is not None and callable(getattr(pipeline, "fuse_lora", None)):
                self._removals.append(MethodPatch(pipeline, "fuse_lora", self._check_fuse(pipeline)))
        except BaseException:
            self._undo()
            raise
        if joins is not None:
            joins.partners.append(self)

    def _load_check(self, keys: tuple[str, ...]) -> Callable[..., None]:
        def check(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
            found = next((prefix + k for k in keys if prefix + k in state_dict), None)
            if found is not None:
                raise HookError(
                    f"{type(module).__name__}.load_state_dict: expected no weights for the {self.count} Linear layers "
                    f"hookkit quantized in place (torchao), got {found!r}. Loading would stop midway inside torchao, and "
                    "hookkit.disable would then restore the old originals into a half-loaded model; nothing was "
                    "loaded. Call hookkit.disable(...) first (with Quantize(keep_original='cpu')), load, then enable "
                    "again."
                )
        return check

    def _refuse_save(self, owner: str, whole_pipeline: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def save_pretrained(*args: Any, **kwargs: Any) -> Any:
                guards = [self, *self.partners] if whole_pipeline else [self]
                got = " and ".join(f"{g._class} with {g.count}" for g in guards)
                raise HookError(
                    f"{owner}.save_pretrained: expected a model with its original weights, got {got} "
                    "Linear layers hookkit quantized in place (torchao): saving would write torchao "
                    "tensors without a quantization config, or fail midway and leave a half-written folder; nothing "
                    "was written. Call hookkit.disable(...) first (Quantize(keep_original='cpu') restores the "
                    "original weights), save, then enable again."
                )
            return save_pretrained
        return make

    def _lora_over_quantized(self) -> list[str]:
        """Paths of the LoRA layers (PEFT's, with a `base_layer`) whose base layer hookkit quantized."""
        return [path for path, m in self._transformer.named_modules()
                if id(getattr(m, "base_layer", None)) in self._quantized]

    def _check_fuse(self, pipeline: Any | None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """`fuse_lora` of the transformer (`pipeline` None), or of the pipeline: refused before diffusers scales
        anything when it would merge a LoRA into a quantized weight; otherwise the original runs."""
        owner = type(pipeline if pipeline is not None else self._transformer).__name__

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def fuse_lora(*args: Any, **kwargs: Any) -> Any:
                for guard in [self] if pipeline is None else [self, *self.partners]:
                    if pipeline is not None and not guard._fuses_transformer(pipeline, original, args, kwargs):
                        continue
                    lora = guard._lora_over_quantized()
                    if lora:
                        raise HookError(
                            f"{owner}.fuse_lora: expected LoRA layers over full-precision weights, got {len(lora)} "
                            f"LoRA layers over Linear layers hookkit quantized in place (torchao), e.g. {lora[0]!r}. "
                            "peft cannot merge a LoRA into torchao's tensors: it would fail midway, after diffusers "
                            "scaled every LoRA layer by lora_scale, and leave them scaled; nothing was scaled or fused. "
                            "Call hookkit.disable(...) first (with Quantize(keep_original='cpu')), fuse, then enable "
                            "again; or keep the LoRA unfused and weigh it with pipe.set_adapters(name, scale).")
                return original(*args, **kwargs)
            return fuse_lora
        return make

    def _fuses_transformer(self, pipeline: Any, original: Callable[..., Any], args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> bool:
        """Whether the pipeline's `fuse_lora(components=...)` names the transformer. A call diffusers refuses itself
        (no components, a wrong argument) is left to diffusers' own error."""
        try:
            bound = inspect.signature(original).bind(*args, **kwargs)
        except (TypeError, ValueError):
            return False
        bound.apply_defaults()
        components = bound.arguments.get("components")
        if not isinstance(components, (list, tuple)):
            return False
        return any(isinstance(c, str) and getattr(pipeline, c, None) is self._transformer for c in components)

    def _undo(self) -> None:
        while self._removals:
            self._removals.pop().remove()
        if self._joined is not None and self in self._joined.partners:
            self._joined.partners.remove(self)
        self._transformer = None
        self._quantized = {}


def _refusal(scheme: str, count: int, what: str) -> str:
    return (f"{what}: {count} Linear weights of the transformer were quantized in place ({scheme}) and their originals "
            f"were not kept, so they cannot be restored. Nothing was removed. Enable with "
            f"hookkit.Quantize(scheme={scheme!r}, keep_original='cpu') (or 'device') so that removal restores "
            "them, or reload the model.")


def _nothing_chosen(report: QuantizeReport, transformer: torch.nn.Module) -> Exception:
    """The refusal of a spec that would quantize no layer: quantizing nothing is a mistake worth saying.

    Hardware comes first: on a device that cannot run the scheme at all, the layers' dtype or shape is not the
    fix (casting a CPU model to bfloat16 for fp8_row would only lead to the next error).
    """
    try:
        check_hardware(report.scheme, (module_at(transformer, d.path).weight.device for d in report.layers))
    except UnsupportedError as exc:
        return exc
    counts = report.counts()
    listed = ", ".join(f"{n} {reason}" for reason, n in counts.items())
    hint = ""
    if ALREADY_QUANTIZED in counts:
        hint += (f"{counts[ALREADY_QUANTIZED]} of its Linear weights are already quantized (by an earlier "
                 "apply_quantize or hookkit.enable, or a model loaded with a quantization config): remove that "
                 "quantization or reload the model to quantize anew. ")
    dtypes = SCHEMES[report.scheme].weight_dtypes
    if dtypes and wrong_dtype(dtypes) in counts:
        hint += (f"Cast the transformer to {' or '.join(_dtype_name(d) for d in dtypes)} first "
                 f"(pipe.to(torch.{_dtype_name(dtypes[0])})). ")
    return SpecError(
        f"Quantize.scheme: {report.scheme!r} would quantize none of the {len(report.layers)} Linear layers of "
        f"{type(transformer).__name__} ({listed}). {hint}Widen the selection (region='all', include=..., "
        "filter_fn=...) or choose another scheme; hookkit.techniques.quantize.torchao.select_layers(transformer, spec) "
        "lists every layer with its reason."
    )


def _checked_config(transformer: torch.nn.Module, report: QuantizeReport) -> Any:
    """The hardware check of every chosen layer's device, then torchao's config: before any weight is touched."""
    check_hardware(report.scheme, (module_at(transformer, d.path).weight.device for d in report.chosen))
    return make_config(report.scheme)


class QuantizeHandle:
    """What `apply_quantize` returns: the report, and `remove()` restoring the originals when they were kept."""

    def __init__(self, report: QuantizeReport, layers: list[QuantizedLayer], keep_original: str | None,
                 guard: QuantizedGuard | None = None) -> None:
        self.report = report
        self.layers = layers
        self.keep_original = keep_original
        self._guard = guard

    def remove(self) -> None:
        if self.keep_original is None and self.layers:
            raise HookError(_refusal(self.report.scheme, len(self.layers), "QuantizeHandle.remove"))
        while self.layers:
            self.layers.pop().remove()
        if self._guard is not None:
            self._guard.remove()


def _quantize_chosen(transformer: torch.nn.Module, report: QuantizeReport, config: Any,
                     keep_original: str | None, model: torch.nn.Module | None = None) -> list[QuantizedLayer]:
    """Each chosen Linear in turn; on failure, restore what was done and re-raise."""
    done: list[QuantizedLayer] = []
    try:
        for d in report.chosen:
            done.append(QuantizedLayer(module_at(transformer, d.path), d.path, config, keep_original, model=model))
    except BaseException:
        while done:
            done.pop().remove()
        raise
    return done


def apply_quantize(transformer: torch.nn.Module, spec: Quantize, adapter: AdapterSpec | None = None) -> QuantizeHandle:
    """Quantize `transformer`'s Linear layers as `spec` says, without `hookkit.enable`.

        handle = apply_quantize(pipe.transformer, hookkit.Quantize(scheme="int8_weight_only", keep_original="cpu"))
        print(handle.report.render())
        handle.remove()  # restores the original weights
    """
    report = select_layers(transformer, spec, adapter)
    if not report.chosen:
        raise _nothing_chosen(report, transformer)
    config = _checked_config(transformer, report)
    guard = QuantizedGuard(transformer, [d.path for d in report.chosen])
    try:
        layers = _quantize_chosen(transformer, report, config, spec.keep_original, model=transformer)
    except BaseException:
        guard.remove()
        raise
    logger.info("quantized {} of {} Linear layers with {}", len(layers), len(report.layers), spec.scheme)
    return QuantizeHandle(report, layers, spec.keep_original, guard)


# --- the feature -----------------------------------------------------------------------------------------


@attrs.define
class _Session:
    """What one handle keeps while quantized: the report and torchao's config."""

    report: QuantizeReport
    config: Any
    #: the handle's guard (`QuantizedGuard`), once attached: a companion transformer's guard joins the owner's
    guard: QuantizedGuard | None = None


def _few(paths: list[str], limit: int = 6) -> str:
    if not paths:
        return "none"
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(paths[:limit]) + more


def _selection_changed(planned: list[str], now: list[str]) -> str:
    """Why attach refuses a selection that differs from the plan's, listing the difference."""
    only_planned = [p for p in planned if p not in set(now)]
    only_now = [p for p in now if p not in set(planned)]
    return (f"hookkit.quantize: expected attach to choose the {len(planned)} Linear layers build_plan chose, got "
            f"{len(now)} (chosen only by build_plan: {_few(only_planned)}; only now: {_few(only_now)}). "
            "Quantize.filter_fn must be deterministic and pure (the same answer for the same module and path, no "
            "state), and the transformer must not change while hookkit.enable runs. Nothing was quantized; fix the "
            "filter_fn and enable again.")


class _QuantizeFeature(BaseFeature):
    """Plugs quantization into `hookkit.enable`: `Spec.quantize`."""

    name = NAME
    spec_class = Quantize

    def plan(self, ctx: PlanContext) -> list[Attachment]:
        report = select_layers(ctx.transformer, ctx.spec.quantize, ctx.adapter)
        if not report.chosen:
            raise _nothing_chosen(report, ctx.transformer)
        guard = Attachment(feature=self.name, target="", name=GUARD)  # first: removed after the layers are restored
        return [guard, *(Attachment(feature=self.name, target=d.path, name=QUANTIZE_HOOK,
                                    params=(("scheme", report.scheme),)) for d in report.chosen)]

    def _session(self, ctx: AttachContext) -> _Session:
        """Made at the first quantize attach, before any weight changes: selection check, hardware, config."""
        session: _Session | None = ctx.kept()
        if session is None:
            spec: Quantize = ctx.spec.quantize  # type: ignore[assignment]
            report = select_layers(ctx.transformer, spec, ctx.adapter)
            planned = [a.target for a in ctx.attachments() if a.name == QUANTIZE_HOOK]
            now = [d.path for d in report.chosen]
            if planned != now:
                raise HookError(_selection_changed(planned, now))
            session = ctx.keep(_Session(report=report, config=_checked_config(ctx.transformer, report)))
            logger.info("quantizing {} of {} Linear layers with {}", len(planned), len(report.layers), spec.scheme)
        return session

    def attach(self, ctx: AttachContext, attachment: Attachment) -> QuantizedLayer | QuantizedGuard:
        session = self._session(ctx)
        if attachment.name == GUARD:
            paths = [a.target for a in ctx.attachments() if a.name == QUANTIZE_HOOK]
            owner: _Session | None = None if ctx.owns_pipeline else ctx.owner_kept()
            joins = owner.guard if owner is not None else None
            session.guard = QuantizedGuard(ctx.transformer, paths, None if joins is not None else ctx.pipeline,
                                           joins=joins)
            return session.guard
        module = module_at(ctx.transformer, attachment.target)
        return QuantizedLayer(module, attachment.target, session.config, ctx.spec.quantize.keep_original,
                              model=ctx.transformer)

    def check_removable(self, ctx: AttachContext) -> None:
        """Called by `Handle.remove` before anything is removed: refuse when weights cannot be restored."""
        spec: Quantize = ctx.spec.quantize  # type: ignore[assignment]
        session: _Session | None = ctx.kept()
        if spec.keep_original is None and session is not None and session.report.chosen:
            raise EnableError(_refusal(spec.scheme, len(session.report.chosen), "hookkit.disable"))

    def summarize(self, ctx: AttachContext) -> FeatureSummary | None:
        session: _Session | None = ctx.kept()
        if session is None:  # a live handle always has one, unless a removal failed midway and cleared it
            return None
        data = session.report.to_data()
        data["keep_original"] = ctx.spec.quantize.keep_original  # type: ignore[union-attr]
        return FeatureSummary(name=self.name, data=data, text=session.report.render(),
                              brief=session.report.render(layers=False))


FEATURE = _QuantizeFeature()

__all__ = [
    "ALREADY_QUANTIZED",
    "FEATURE",
    "LORA",
    "SCHEMES",
    "LayerDecision",
    "QuantizeHandle",
    "QuantizeReport",
    "QuantizedLayer",
    "SchemeInfo",
    "apply_quantize",
    "check_hardware",
    "layer_filter",
    "make_config",
    "pattern_path",
    "select_layers",
    "unsupported_reason",
    "wrong_dtype",
]
