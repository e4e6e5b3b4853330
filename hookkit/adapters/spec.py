"""The adapter schema: `AdapterSpec` and `BlockListSpec`, loaded from TOML and validated into frozen attrs.

An adapter says which transformer class it is for (exact class name, never a prefix; a dotted path
"pkg.module.Class" names one class exactly and wins over a bare name), which block lists run in which
order, what each block class takes and returns, which classes are repeated (for regional compilation),
which Linear layers must never be quantized, how CFG is run, where per-step index tensors are built, and (for a
class diffusers ships without `_cp_plan`) how context parallelism splits and gathers the sequence (`[[cp_plan]]`).
"""

from __future__ import annotations

import inspect
import sys
import tomllib
from pathlib import Path
from typing import Any

import attrs
import torch

from hookkit.errors import AdapterError, field_error

STREAMS = ("hidden_states", "encoder_hidden_states")
CFG_STYLES = ("batched", "separate")
METADATA_MODES = ("check", "ignore")
MEMO_SCOPES = ("none", "prologue")


def _fail(where: str, field: str, value: Any, expected: str, fix: str = "") -> AdapterError:
    """`errors.field_error` for an adapter: `adapter 'name' (source).field: expected ..., got ....`"""
    return field_error(f"adapter {where}", field, value, expected, fix, error=AdapterError)


def _tuple(value: Any) -> Any:
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list) else value


def _strings(where: str, field: str, value: Any, allow_empty: bool = True) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value) or (not allow_empty and not value):
        raise _fail(where, field, value, "a list of non-empty strings" + ("" if allow_empty else " (at least one)"))


def _tables(where: str, field: str, value: Any, cls: type, expected: str, allow_empty: bool = True) -> None:
    """A list of `cls` tables (`[[blocks]]`, `[[cp_plan]]`), each validated."""
    if not isinstance(value, tuple) or (not allow_empty and not value) or not all(isinstance(t, cls) for t in value):
        raise _fail(where, field, value, expected)
    for table in value:
        table.validate(where)


def _once(where: str, field: str, keys: list[str], expected: str) -> None:
    """Each of the tables' `keys` at most once."""
    if len(set(keys)) != len(keys):
        raise _fail(where, field, keys, expected)


def _names_class(entry: str, cls: type) -> bool:
    """True when the dotted path `entry` ("pkg.module.Class") names `cls` itself (not a same-named class): the class's
    own module and qualified name, or a re-export from a package its module is in ("diffusers.FluxTransformer2DModel"),
    read from that package, already imported with the class. Compared as strings otherwise: nothing an adapter names is
    ever imported, so a shared adapter file cannot run code by naming a module."""
    if entry == f"{cls.__module__}.{cls.__qualname__}":
        return True
    package_name, _, name = entry.rpartition(".")
    if name != cls.__name__ or not cls.__module__.startswith(package_name + "."):
        return False
    package = sys.modules.get(package_name)
    try:
        return package is not None and getattr(package, name, None) is cls
    except Exception:  # a lazy package failing to load its own submodule names no class of this process
        return False


@attrs.frozen(kw_only=True)
class BlockListSpec:
    """One `nn.ModuleList` of blocks on the transformer, in execution order among the others.

    `returns` names, per return position, which stream the block returns there: Flux and Qwen-Image
    blocks return `("encoder_hidden_states", "hidden_states")`, Wan blocks `("hidden_states",)`.
    `encoder_arg` is the argument that carries the second stream the block returns: the encoder (text) stream of
    MMDiT blocks, the audio stream of LTX-2's; leave it out (None) for blocks that return only the hidden stream.
    `long_skips`: the forward also feeds block i's output into block n-1-i (U-Net-style long skips, HunyuanDiT);
    only symmetric DBCache splits (fn_blocks == bn_blocks) keep the math there, and DBCache refuses the others.

    Args:
        attr: the name of the `nn.ModuleList` attribute on the transformer.
        classes: the block class name(s) the list holds (TOML: `class`, one name or a list of variants).
        hidden_arg: the block forward's argument carrying the hidden (image/video) stream.
        encoder_arg: the argument of the second returned stream, or None.
        returns: per return position, which stream the block returns there.
        long_skips: whether outputs of this list's blocks also feed later blocks of it directly (see above).
    """

    attr: str
    classes: tuple[str, ...] = attrs.field(converter=_tuple)
    hidden_arg: str = "hidden_states"
    encoder_arg: str | None = None
    returns: tuple[str, ...] = attrs.field(default=("hidden_states",), converter=_tuple)
    long_skips: bool = False

    def validate(self, where: str) -> None:
        if not isinstance(self.attr, str) or not self.attr.isidentifier():
            raise _fail(where, "blocks.attr", self.attr, "the name of an nn.ModuleList attribute of the transformer")
        _strings(where, f"blocks[{self.attr}].classes", self.classes, allow_empty=False)
        if not isinstance(self.hidden_arg, str) or not self.hidden_arg:
            raise _fail(where, f"blocks[{self.attr}].hidden_arg", self.hidden_arg, "an argument name")
        if self.encoder_arg is not None and (not isinstance(self.encoder_arg, str) or not self.encoder_arg):
            raise _fail(where, f"blocks[{self.attr}].encoder_arg", self.encoder_arg, "an argument name or absent")
        _strings(where, f"blocks[{self.attr}].returns", self.returns, allow_empty=False)
        bad = [r for r in self.returns if r not in STREAMS]
        if bad or "hidden_states" not in self.returns or len(set(self.returns)) != len(self.returns):
            raise _fail(
                where, f"blocks[{self.attr}].returns", list(self.returns),
                f"each of {STREAMS} at most once, 'hidden_states' included, in return order",
            )
        if not isinstance(self.long_skips, bool):
            raise _fail(where, f"blocks[{self.attr}].long_skips", self.long_skips, "true or false")
        if "encoder_hidden_states" in self.returns and self.encoder_arg is None:
            raise _fail(where, f"blocks[{self.attr}].encoder_arg", None, "an argument name, since the block returns the encoder stream")

    @property
    def hidden_index(self) -> int:
        return self.returns.index("hidden_states")

    @property
    def encoder_index(self) -> int | None:
        return self.returns.index("encoder_hidden_states") if "encoder_hidden_states" in self.returns else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_dims(where: str, field: str, dim: Any, expected_dims: Any, dim_name: str) -> None:
    if not _is_int(dim):
        raise _fail(where, f"{field}.{dim_name}", dim, "an int (the sequence dimension of the tensor)")
    if expected_dims is not None and (not _is_int(expected_dims) or expected_dims < 1):
        raise _fail(where, f"{field}.expected_dims", expected_dims, "an int >= 1 (the tensor's number of dims) or absent")
    if expected_dims is not None and not -expected_dims <= dim < expected_dims:
        raise _fail(where, f"{field}.{dim_name}", dim, f"a dim of a {expected_dims}-dim tensor "
                    f"({-expected_dims} .. {expected_dims - 1})", "Fix the dim or expected_dims.")


@attrs.frozen(kw_only=True)
class CPSplit:
    """One tensor context parallelism splits along its sequence dim: diffusers' `ContextParallelInput`.

    Exactly one of `input` and `output`: `input` splits a forward argument before the module runs (diffusers keys it
    by name); `output` splits the module's output at that index after it runs (diffusers' `split_output=True`, keyed
    by index: RoPE tables computed from the whole sequence, then cut like it).

    Args:
        input: the name of an argument of the module's `forward` to split, or None.
        output: the index of the module's output to split (0 for a module returning one tensor), or None.
        split_dim: the dimension to split (the sequence dimension of that tensor).
        expected_dims: the tensor's number of dims; diffusers splits only tensors with that many (others pass
            whole, with a warning). None splits any.
    """

    split_dim: int
    input: str | None = None
    output: int | None = None
    expected_dims: int | None = None

    def validate(self, where: str, field: str) -> None:
        if (self.input is None) == (self.output is None):
            raise _fail(where, field, {"input": self.input, "output": self.output},
                        "exactly one of `input` (a forward argument name) and `output` (an output index)")
        if self.input is not None and (not isinstance(self.input, str) or not self.input.isidentifier()):
            raise _fail(where, f"{field}.input", self.input, "the name of a forward argument (a string)")
        if self.output is not None and (not _is_int(self.output) or self.output < 0):
            raise _fail(where, f"{field}.output", self.output, "an output index (an int >= 0)")
        _check_dims(where, field, self.split_dim, self.expected_dims, "split_dim")

    @property
    def key(self) -> str | int:
        """diffusers' key: the argument name, or the output index."""
        return self.input if self.input is not None else self.output  # type: ignore[return-value]


@attrs.frozen(kw_only=True)
class CPGather:
    """One output gathered back into the whole sequence on every rank: diffusers' `ContextParallelOutput`.

    Args:
        gather_dim: the dimension to gather (the sequence dimension of that output).
        expected_dims: the output's number of dims (documentation for diffusers; checked by hookkit at every call).
    """

    gather_dim: int
    expected_dims: int | None = None

    def validate(self, where: str, field: str) -> None:
        _check_dims(where, field, self.gather_dim, self.expected_dims, "gather_dim")


def _module_path_ok(path: str) -> bool:
    if path == "":
        return True
    atoms = path.split(".")
    return path.count("*") <= 1 and all(a == "*" or a.isidentifier() or a.isdigit() for a in atoms)


@attrs.frozen(kw_only=True)
class CPPlanEntry:
    """One module of a context-parallel plan (TOML: one `[[cp_plan]]` table): what is split or gathered there.

    Args:
        module: the module path under the transformer ("" for the transformer itself, "blocks.0" for one block,
            "blocks.*" for every block of a list; diffusers' module ids).
        split: the tensors split at this module (inputs before it runs, outputs after), or empty.
        gather: the outputs gathered at this module, one per output position, or empty. A module has `split`
            or `gather`, not both (diffusers' plan maps a module to one or the other).
    """

    module: str
    split: tuple[CPSplit, ...] = attrs.field(default=(), converter=_tuple)
    gather: tuple[CPGather, ...] = attrs.field(default=(), converter=_tuple)

    def validate(self, where: str) -> None:
        if not isinstance(self.module, str) or not _module_path_ok(self.module):
            raise _fail(where, "cp_plan.module", self.module,
                        'a module path under the transformer ("" for itself, "blocks.0", "blocks.*")')
        field = f"cp_plan[{self.module!r}]"
        if not isinstance(self.split, tuple) or not all(isinstance(s, CPSplit) for s in self.split):
            raise _fail(where, f"{field}.split", self.split, "a list of tables {input|output, split_dim, expected_dims}")
        if not isinstance(self.gather, tuple) or not all(isinstance(g, CPGather) for g in self.gather):
            raise _fail(where, f"{field}.gather", self.gather, "a list of tables {gather_dim, expected_dims}")
        if bool(self.split) == bool(self.gather):
            raise _fail(where, field, {"split": len(self.split), "gather": len(self.gather)},
                        "either `split` or `gather` (not both, not neither)",
                        "Split the module's tensors in one [[cp_plan]] table and gather another module's outputs in another.")
        for i, split in enumerate(self.split):
            split.validate(where, f"{field}.split[{i}]")
        for i, gather in enumerate(self.gather):
            gather.validate(where, f"{field}.gather[{i}]")
        keys = [s.key for s in self.split]
        if len(set(keys)) != len(keys):
            raise _fail(where, f"{field}.split", keys, "each input name or output index once")

    def diffusers_value(self) -> Any:
        """This entry in diffusers' vocabulary: a dict of `ContextParallelInput`, or a list of `ContextParallelOutput`."""
        from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

        if self.split:
            return {s.key: ContextParallelInput(split_dim=s.split_dim, expected_dims=s.expected_dims,
                                                split_output=s.output is not None) for s in self.split}
        outputs = [ContextParallelOutput(gather_dim=g.gather_dim, expected_dims=g.expected_dims) for g in self.gather]
        return outputs[0] if len(outputs) == 1 else outputs


def _submodules(root: torch.nn.Module, path: str) -> list[torch.nn.Module] | str:
    """The modules `path` names under `root` (several for a `*`), the way diffusers resolves module ids; a string
    saying what is missing when it names none."""
    modules = [root]
    if path == "":
        return modules
    for atom in path.split("."):
        found: list[torch.nn.Module] = []
        for module in modules:
            if atom == "*":
                if not isinstance(module, torch.nn.ModuleList):
                    return f"'*' stands for the items of an nn.ModuleList, not of {type(module).__name__}"
                found.extend(module)
            else:
                child = getattr(module, atom, None)
                if not isinstance(child, torch.nn.Module):
                    return f"{type(module).__name__} has no submodule {atom!r}"
                found.append(child)
        modules = found
    return modules if modules else "an empty nn.ModuleList"


def _pairs(value: Any) -> Any:
    return tuple(value.items()) if isinstance(value, dict) else value


@attrs.frozen(kw_only=True)
class AdapterSpec:
    """What hookkit needs to know about one transformer family. Build it in Python or load it from TOML.

    Args:
        name: the adapter's name (unique among registered adapters).
        transformer: the exact class name(s) (or dotted paths) of the transformer it describes; a dotted path is
            compared with the class's own module and name (or a re-export from its package), never imported.
        blocks: the block lists DBCache may cache, in execution order; together they form one chain (each block's
            hidden input is the previous block's hidden output; checked at the first call).
        repeated_blocks: block classes compiled as regions (and quantized with `region="repeated_blocks"`).
        quant_exclude: fnmatch patterns of module paths never quantized.
        cfg: "batched" (one call per step) or "separate" (one call per CFG branch).
        memo_scope: "none" or "prologue" (where per-step index tensors are built).
        pipelines: pipeline class names the adapter is meant for (documentation).
        left_out: `nn.ModuleList`s of the transformer that are not in `blocks`, each with the reason (a refiner
            stage, a list that runs inside another's loop, ...): TOML table `[left_out]`; the summary shows them.
        notes: free text kept with the adapter, e.g. where diffusers' block metadata disagrees with the code.
        diffusers_metadata: "check" compares the blocks with diffusers' `TransformerBlockRegistry` at enable and
            refuses a disagreement; "ignore" where that entry is known wrong for this model (say why in `notes`).
        cp_plan: a context-parallel plan in diffusers' vocabulary (`[[cp_plan]]` tables, see `CPPlanEntry`), used by
            `Spec(parallel=...)` on a class diffusers ships without `_cp_plan`. Module paths and input names are
            checked against the model when the adapter is matched.
        cp_plan_override: False (default): where the class has its own `_cp_plan`, diffusers' plan is used and
            `cp_plan` is not; True: `cp_plan` is used even then (say why in `notes`).
        host_syncs: where the transformer's own forward, outside its blocks, waits for the host (a Python branch
            on a tensor's value, boolean-mask indexing, `.item()`), one line each: no CUDA graph can capture that,
            so `Compile(cuda_graphs="transformer")` is refused at enable, naming them, instead of failing at its
            first capture after a whole eager call. Tests check each declared model against the capture.
    """

    name: str
    transformer: tuple[str, ...] = attrs.field(converter=_tuple)
    blocks: tuple[BlockListSpec, ...] = attrs.field(converter=_tuple)
    repeated_blocks: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    quant_exclude: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    #: fnmatch patterns of the AdaLN modulation Linears (timestep embedding -> shift/scale/gate): kept out of
    #: quantization like `quant_exclude`, unless `Quantize(include_modulation=True)` asks for them
    quant_modulation: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    cfg: str = "batched"
    memo_scope: str = "none"
    pipelines: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    left_out: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_pairs)
    notes: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    diffusers_metadata: str = "check"
    #: arguments of the transformer's `forward` whose tensors the model adds into the streams *between* blocks
    #: (Flux's `controlnet_block_samples` / `controlnet_single_block_samples`, Qwen-Image's
    #: `controlnet_block_samples`; Wan VACE's `control_hidden_states`, from which its `vace_blocks` make the hints
    #: added after the blocks in `vace_layers`). On a call where any is given, DBCache keeps only the blocks' own
    #: contribution in its cached residual, so a cached step adds the current step's residuals or hints once. Name
    #: an argument only if what the model adds from it does not depend on the blocks DBCache skips (both of these
    #: are computed before the first block, from the call's inputs).
    between_block_args: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    cp_plan: tuple[CPPlanEntry, ...] = attrs.field(default=(), converter=_tuple)
    cp_plan_override: bool = False
    host_syncs: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    source: str = "python"

    def __attrs_post_init__(self) -> None:
        where = f"{self.name!r} ({self.source})"
        if not isinstance(self.name, str) or not self.name:
            raise _fail(repr(self.name), "name", self.name, "a non-empty string")
        _strings(where, "transformer", self.transformer, allow_empty=False)
        _tables(where, "blocks", self.blocks, BlockListSpec, "at least one [[blocks]] table (BlockListSpec)",
                allow_empty=False)
        attrs_seen = [b.attr for b in self.blocks]
        _once(where, "blocks", attrs_seen, "each block list attribute once")
        _strings(where, "repeated_blocks", self.repeated_blocks)
        _strings(where, "quant_exclude", self.quant_exclude)
        _strings(where, "quant_modulation", self.quant_modulation)
        _strings(where, "pipelines", self.pipelines)
        _strings(where, "between_block_args", self.between_block_args)
        _strings(where, "host_syncs", self.host_syncs)
        if self.cfg not in CFG_STYLES:
            raise _fail(where, "cfg", self.cfg, f"one of {CFG_STYLES} (one batched call per step, or one call per CFG branch)")
        if self.memo_scope not in MEMO_SCOPES:
            raise _fail(where, "memo_scope", self.memo_scope, f"one of {MEMO_SCOPES}")
        _strings(where, "notes", self.notes)
        if self.diffusers_metadata not in METADATA_MODES:
            raise _fail(where, "diffusers_metadata", self.diffusers_metadata, f"one of {METADATA_MODES}")
        if not isinstance(self.left_out, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) and x for x in p) for p in self.left_out):
            raise _fail(where, "left_out", self.left_out, "a table of list attribute = \"reason\"")
        clash = sorted({a for a, _ in self.left_out} & set(attrs_seen))
        if clash:
            raise _fail(where, "left_out", clash, "only lists that are not [[blocks]]", "Remove them from [left_out].")
        _tables(where, "cp_plan", self.cp_plan, CPPlanEntry, "a list of [[cp_plan]] tables (CPPlanEntry)")
        modules = [e.module for e in self.cp_plan]
        _once(where, "cp_plan", modules, "each module path in one [[cp_plan]] table")
        if self.cp_plan and not any(e.gather for e in self.cp_plan):
            raise _fail(where, "cp_plan", modules, "a table that gathers the sequence back (`gather`), e.g. at the "
                        "output projection", "Without one every rank returns only its shard.")
        if self.cp_plan and not any(e.split for e in self.cp_plan):
            raise _fail(where, "cp_plan", modules, "a table that splits the sequence (`split`)")
        if not isinstance(self.cp_plan_override, bool):
            raise _fail(where, "cp_plan_override", self.cp_plan_override, "true or false")
        if self.cp_plan_override and not self.cp_plan:
            raise _fail(where, "cp_plan_override", True, "a [[cp_plan]] to override with", "Add one or drop the key.")

    @property
    def left_out_reasons(self) -> dict[str, str]:
        """`left_out` as a dict: list attribute -> why the adapter leaves it out."""
        return dict(self.left_out)

    def diffusers_cp_plan(self) -> dict[str, Any] | None:
        """`cp_plan` as diffusers' `ContextParallelModelPlan` (module id -> inputs split / outputs gathered), or None."""
        if not self.cp_plan:
            return None
        return {e.module: e.diffusers_value() for e in self.cp_plan}

    def check_cp_plan(self, transformer: torch.nn.Module) -> None:
        """Raise `AdapterError` unless every `cp_plan` module exists in `transformer` and every split input is an
        argument of its module's `forward` (diffusers would only fail inside the first parallel call)."""
        where = f"{self.name!r} ({self.source})"
        for entry in self.cp_plan:
            found = _submodules(transformer, entry.module)
            if isinstance(found, str):
                raise _fail(where, "cp_plan.module", entry.module, f"a module path under {type(transformer).__name__}",
                            f"{found}; name a module of this model.")
            for module in found:
                params = list(inspect.signature(type(module).forward).parameters)[1:]
                for i, split in enumerate(entry.split):
                    if split.input is not None and split.input not in params:
                        raise _fail(where, f"cp_plan[{entry.module!r}].split[{i}].input", split.input,
                                    f"an argument of {type(module).__name__}.forward {params}",
                                    "Name the argument that carries the sequence, or split an output instead.")

    # -- matching -------------------------------------------------------------------------------------
    def matches(self, transformer: torch.nn.Module) -> bool:
        """Exact class match: the class name, or a dotted path naming this very class, is listed. No prefixes."""
        return self.match_level(transformer) > 0

    def match_level(self, transformer: torch.nn.Module) -> int:
        """2: a dotted path names `type(transformer)` itself; 1: its bare class name is listed; 0: no match.

        A dotted path ("pkg.module.Class", re-exports such as "diffusers.FluxTransformer2DModel" included)
        is more specific than a bare name, so it wins when two adapters claim one class name. Matching imports nothing.
        """
        cls = type(transformer)
        if any(_names_class(entry, cls) for entry in self.transformer if "." in entry):
            return 2
        return 1 if cls.__name__ in self.transformer else 0

    def block_lists(self, transformer: torch.nn.Module) -> list[tuple[BlockListSpec, torch.nn.ModuleList]]:
        """The transformer's block lists in execution order, each with its spec (after `check`)."""
        return [(b, getattr(transformer, b.attr)) for b in self.blocks]

    def repeated_block_classes(self) -> tuple[str, ...]:
        """The classes regional compilation and quantization work on: `repeated_blocks`, else every block class."""
        return self.repeated_blocks or tuple(dict.fromkeys(c for b in self.blocks for c in b.classes))

    def repeated_block_paths(self, transformer: torch.nn.Module) -> list[str]:
        """Module paths of every instance of `repeated_block_classes()` in `transformer`, in module order."""
        classes = set(self.repeated_block_classes())
        return [path for path, m in transformer.named_modules() if path and type(m).__name__ in classes]

    def check(self, transformer: torch.nn.Module) -> None:
        """Raise `AdapterError` unless this adapter describes `transformer` exactly."""
        cls_name = type(transformer).__name__
        where = f"{self.name!r} ({self.source})"
        if not self.matches(transformer):
            raise _fail(where, "transformer", list(self.transformer), f"to list the class {cls_name!r} of the model it is used on",
                        "Use the adapter written for this class, or add the class name to `transformer`.")
        for block in self.blocks:
            modules = getattr(transformer, block.attr, None)
            if not isinstance(modules, torch.nn.ModuleList):
                raise _fail(where, "blocks.attr", block.attr, f"an nn.ModuleList attribute of {cls_name}",
                            f"{cls_name} has {type(modules).__name__ if modules is not None else 'no such attribute'}.")
            checked: set[type] = set()
            for i, module in enumerate(modules):
                module_cls = type(module)
                if module_cls.__name__ not in block.classes:
                    raise _fail(where, f"blocks[{block.attr}].classes", list(block.classes),
                                f"to list the class of {block.attr}.{i}", f"It is {module_cls.__name__!r}.")
                if module_cls not in checked:
                    checked.add(module_cls)
                    _check_block_class(where, block, f"{block.attr}.{i}", module_cls,
                                       metadata=self.diffusers_metadata == "check")
        if self.between_block_args:
            forward_args = list(inspect.signature(type(transformer).forward).parameters)[1:]
            unknown = [a for a in self.between_block_args if a not in forward_args]
            if unknown:
                raise _fail(where, "between_block_args", unknown, f"arguments of {cls_name}.forward {forward_args}",
                            "Name the forward arguments the model adds between blocks, or remove the field.")
        self.check_cp_plan(transformer)
        present = {type(m).__name__ for m in transformer.modules()}
        variants = {c for b in self.blocks for c in b.classes}
        # A block class listed as a variant (e.g. HunyuanVideo's token-replace blocks) may be absent from
        # one configuration of the model; anything else named in repeated_blocks must occur in it.
        missing = [c for c in self.repeated_blocks if c not in present and c not in variants]
        if missing:
            raise _fail(where, "repeated_blocks", missing, f"classes that occur inside {cls_name}",
                        "Remove them, or list them as a `class` of a [[blocks]] table if they are block variants.")
        if self.repeated_blocks and not present.intersection(self.repeated_blocks):
            raise _fail(where, "repeated_blocks", list(self.repeated_blocks),
                        f"at least one class that occurs inside {cls_name}", "Name the classes of its blocks.")

    # -- data -----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "dict") -> AdapterSpec:
        if not isinstance(data, dict):
            raise _fail(source, "<root>", data, "a table")
        if any(not isinstance(key, str) for key in data):
            raise _fail(source, "<root>", next(k for k in data if not isinstance(k, str)), "string keys")
        known = {f.name for f in attrs.fields(cls)} - {"source"}
        unknown = sorted(set(data) - known)
        where = f"{data.get('name', '?')!r} ({source})"
        if unknown:
            raise _fail(where, unknown[0], data[unknown[0]], f"one of the known keys {sorted(known)}", "Remove or rename it.")
        for key in ("name", "transformer", "blocks"):
            if key not in data:
                raise _fail(where, key, None, "to be present", f"Add `{key} = ...` (see the files in adapters/).")
        block_known = {f.name for f in attrs.fields(BlockListSpec)} | {"class"}
        blocks = []
        raw_blocks = data["blocks"]
        if not isinstance(raw_blocks, list):
            raise _fail(where, "blocks", raw_blocks, "a list of [[blocks]] tables")
        for raw in raw_blocks:
            if not isinstance(raw, dict) or any(not isinstance(key, str) for key in raw):
                raise _fail(where, "blocks", raw, "a [[blocks]] table (string keys)")
            bad = sorted(set(raw) - block_known)
            if bad:
                raise _fail(where, f"blocks.{bad[0]}", raw[bad[0]], f"one of {sorted(block_known)}", "Remove or rename it.")
            raw = dict(raw)
            if "class" in raw and "classes" in raw:
                raise _fail(where, f"blocks[{raw.get('attr', '?')}].classes", raw["classes"],
                            "to be absent, since 'class' is given", "Keep one of 'class' and 'classes'.")
            if "class" in raw:
                raw["classes"] = raw.pop("class")
            if "attr" not in raw or "classes" not in raw:
                raise _fail(where, "blocks", raw, "'attr' and 'class' in every [[blocks]] table")
            blocks.append(BlockListSpec(**raw))
        extra: dict[str, Any] = {}
        if "cp_plan" in data:
            extra["cp_plan"] = _cp_plan_from_data(where, data["cp_plan"])
        return cls(**{**data, **extra, "blocks": blocks, "source": source})

    @classmethod
    def from_toml(cls, path: str | Path) -> AdapterSpec:
        """Load and validate one adapter file; anything wrong with the file is an `AdapterError` naming it."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise AdapterError(f"adapter file {str(path)!r} does not exist.") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise AdapterError(f"adapter file {str(path)!r} is not valid TOML: {exc}.") from None
        except OSError as exc:  # a directory, no permission, ...
            raise AdapterError(f"adapter file {str(path)!r} cannot be read ({exc.strerror}); pass the path of a "
                               ".toml file.") from None
        except RecursionError:  # tomllib parses nested arrays and inline tables recursively
            raise _too_deep(path) from None
        try:
            return cls.from_dict(data, source=str(path))
        except RecursionError:  # a nested value that parsed but is too deep to validate or print
            raise _too_deep(path) from None


def _too_deep(path: Path) -> AdapterError:
    return AdapterError(
        f"adapter file {str(path)!r}: expected values nested at most a few levels (lists of strings, [[tables]], "
        "inline tables), got arrays or tables nested too deeply to read (Python's recursion limit). Flatten the "
        "nested value; the files in adapters/ show the shape of every key.")


def _table(where: str, field: str, raw: Any, known: set[str]) -> dict[str, Any]:
    if not isinstance(raw, dict) or any(not isinstance(key, str) for key in raw):
        raise _fail(where, field, raw, "a table (string keys)")
    bad = sorted(set(raw) - known)
    if bad:
        raise _fail(where, f"{field}.{bad[0]}", raw[bad[0]], f"one of {sorted(known)}", "Remove or rename it.")
    return raw


def _cp_plan_from_data(where: str, raw_plan: Any) -> tuple[CPPlanEntry, ...]:
    """`[[cp_plan]]` tables (TOML data) into `CPPlanEntry`s; unknown keys refused with the field's path."""
    if not isinstance(raw_plan, list):
        raise _fail(where, "cp_plan", raw_plan, "a list of [[cp_plan]] tables")
    entries = []
    for raw in raw_plan:
        raw = _table(where, "cp_plan", raw, {f.name for f in attrs.fields(CPPlanEntry)})
        if "module" not in raw:
            raise _fail(where, "cp_plan", raw, "'module' in every [[cp_plan]] table", 'Add module = "..." ("" for the transformer).')
        field = f"cp_plan[{raw['module']!r}]"
        items: dict[str, Any] = {}
        for key, item_cls, dim in (("split", CPSplit, "split_dim"), ("gather", CPGather, "gather_dim")):
            if key in raw:
                if not isinstance(raw[key], list):
                    raise _fail(where, f"{field}.{key}", raw[key], "a list of inline tables")
                known = {f.name for f in attrs.fields(item_cls)}
                items[key] = []
                for i, item in enumerate(raw[key]):
                    item = _table(where, f"{field}.{key}[{i}]", item, known)
                    if dim not in item:
                        raise _fail(where, f"{field}.{key}[{i}].{dim}", None, "to be present (the sequence dimension)",
                                    f"Add {dim} = ... (1 for (batch, tokens, channels) tensors).")
                    items[key].append(item_cls(**item))
        entries.append(CPPlanEntry(**{**raw, **items}))
    return tuple(entries)


def _block_metadata(block_cls: type) -> Any | None:
    """diffusers' `TransformerBlockRegistry` entry for exactly `block_cls` (never a subclass), or None."""
    from hookkit.core.quiet import quiet_imports

    try:
        with quiet_imports():  # the first diffusers.hooks import loads torchao, which talks on a CPU machine
            from diffusers.hooks._helpers import TransformerBlockRegistry
    except ImportError:  # pragma: no cover - diffusers always has it at >= 0.35
        return None
    try:
        with quiet_imports():  # the registry's first lookup imports every diffusers transformer
            return TransformerBlockRegistry.get(block_cls)
    except ValueError:  # not registered
        return None


def _registered_returns(meta: Any) -> list[str]:
    """The stream at each return position of a block, from its `TransformerBlockMetadata`."""
    indices = {"hidden_states": meta.return_hidden_states_index,
               "encoder_hidden_states": meta.return_encoder_hidden_states_index}
    returns = [""] * (1 + max(i for i in indices.values() if i is not None))
    for stream, index in indices.items():
        if index is not None:
            returns[index] = stream
    return returns


def _check_block_class(where: str, block: BlockListSpec, path: str, block_cls: type, metadata: bool = True) -> None:
    """Argument names against the signature, return order against diffusers' metadata where it has some.

    A wrong return order silently mixes the two streams up, so it is caught here, at enable time, rather
    than as a shape error (or worse, none) deep inside a forward.
    """
    name = block_cls.__name__
    params = inspect.signature(block_cls.forward).parameters
    for field, arg in (("hidden_arg", block.hidden_arg), ("encoder_arg", block.encoder_arg)):
        if arg is not None and arg not in params:
            raise _fail(where, f"blocks[{block.attr}].{field}", arg,
                        f"an argument of {name}.forward ({list(params)[1:]}) for {path}",
                        f"Set {field} to the name {name}.forward gives that stream.")
    meta = _block_metadata(block_cls) if metadata else None
    if meta is None:
        return
    registered = _registered_returns(meta)
    if list(block.returns) != registered:
        raise _fail(where, f"blocks[{block.attr}].returns", list(block.returns),
                    f"{registered}, the return order diffusers registers for {name} ({path})",
                    f"Set returns = {registered}.")
    for field, ours, theirs, used in (
        ("hidden_arg", block.hidden_arg, meta.hidden_states_argument_name, True),
        ("encoder_arg", block.encoder_arg, meta.encoder_hidden_states_argument_name,
         block.encoder_arg is not None and meta.return_encoder_hidden_states_index is not None),
    ):
        if used and theirs in params and ours != theirs:
            raise _fail(where, f"blocks[{block.attr}].{field}", ours,
                        f"{theirs!r}, the argument diffusers registers for {name} ({path})", f"Set {field} = {theirs!r}.")
