"""Adapters derived from the transformer's own code, for transformers no adapter file names.

1. The transformer's `forward` (and the methods of its own class it calls) is parsed with `inspect.getsource` +
   `ast`; every call of a block of one of its `nn.ModuleList`s is found (`for block in self.blocks`, `enumerate`,
   slices, `zip`, `self._gradient_checkpointing_func(block, ...)`, `self.blocks[i](...)`, local aliases). The order
   of each list's first call is the execution order.
2. At each call site the arguments are bound to the block's `forward` signature and the assignment targets are read:
   `encoder_hidden_states, hidden_states = block(hidden_states=hidden_states, ...)` says which streams it carries
   and in which return order. The block class's own `return` statements must agree.
3. A list is left out, with the reason in `left_out` (shown by the summary), when it does not carry the stream the
   last list carries (a refiner, VACE's control stream, caption projections), when the forward rebuilds that stream
   after it (Lumina2's joint sequence, Flux.2's concatenation: a stage before the cached chain), or when it runs
   inside another list's loop (WanAnimate's face adapter). Calls passing `skip` (HunyuanDiT) mark `long_skips`.
4. diffusers' `TransformerBlockRegistry`, where it has an entry, only breaks the tie of which of two carried streams
   is the hidden one; where it disagrees with the code that goes into `notes` and the code wins.

`hookkit.core.firstcall` confirms all of it at the first transformer call; a disagreement there is an `AdapterError`.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import attrs
import torch

from hookkit.adapters.spec import AdapterSpec, BlockListSpec, _block_metadata, _registered_returns
from hookkit.errors import AdapterError

CUSTOM_ADAPTER_HELP = (
    "Write an adapter: a TOML file with `name`, `transformer = [\"<ExactClassName>\"]` and one [[blocks]] table "
    "per nn.ModuleList of blocks in execution order (attr, class, hidden_arg, encoder_arg, returns), then call "
    "hookkit.register_adapter(path). `hookkit adapter derive <Class>` prints a starting point; see "
    "examples/custom_adapter.py and the files in adapters/."
)

#: keyword arguments that carry a U-Net-style long skip into a block (HunyuanDiT)
SKIP_ARGS = ("skip", "skips", "skip_connection")


@attrs.define
class CallSite:
    """One call of a block of list `attr` found in the forward (or a helper it calls)."""

    attr: str
    order: int
    lineno: int
    function: str
    #: block forward parameter -> the variable passed to it (None for an expression)
    passed: dict[str, str | None]
    #: the assignment targets of the call's result, in order (None for a non-name target); () if not assigned
    targets: tuple[str | None, ...]
    #: the list whose loop encloses this call, if any
    inside: str | None
    #: positional-only call through the gradient checkpointing helper
    checkpointed: bool
    #: traversal order of the `for` over this list that encloses the call (the call's own order if none)
    loop_start: int


@attrs.define
class _Assign:
    order: int
    lineno: int
    names: tuple[str, ...]
    block_call: bool
    #: inside the loop over a block list (between its blocks, not between two lists)
    in_loop: bool


@attrs.frozen(kw_only=True)
class Derivation:
    """What the code says: the adapter, the lists left out (with why), and where diffusers' metadata disagrees."""

    adapter: AdapterSpec
    left_out: dict[str, str]
    notes: tuple[str, ...]


def _block_lists(transformer: torch.nn.Module) -> dict[str, torch.nn.ModuleList]:
    return {name: child for name, child in transformer.named_children()
            if isinstance(child, torch.nn.ModuleList) and len(child) > 0}


def _params(block_cls: type) -> list[str]:
    return list(inspect.signature(block_cls.forward).parameters)[1:]


def _self_attr(node: ast.AST) -> str | None:
    """`self.<name>` -> name."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _is_call_of(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name and bool(node.args)


def _target_names(target: ast.AST) -> tuple[str | None, ...]:
    if isinstance(target, ast.Name):
        return (target.id,)
    if isinstance(target, (ast.Tuple, ast.List)):
        return tuple(e.id if isinstance(e, ast.Name) else None for e in target.elts)
    return (None,)


def _parse(fn: Any) -> ast.FunctionDef | None:
    """The function's AST, line numbers those of its file."""
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None
    tree = ast.parse(textwrap.dedent("".join(lines)))
    ast.increment_lineno(tree, first - 1)
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


class _Reader(ast.NodeVisitor):
    """Walks a forward in source order, inlining calls of the class's own methods, and records block calls."""

    def __init__(self, cls: type, lists: dict[str, torch.nn.ModuleList]) -> None:
        self.cls = cls
        self.lists = lists
        self.params = {attr: _params(type(ml[0])) for attr, ml in lists.items()}
        self.sites: list[CallSite] = []
        self.assigns: list[_Assign] = []
        self.order = 0
        self.loop_vars: list[dict[str, str]] = [{}]
        self.loops: list[str] = []
        self.loop_starts: list[int] = []
        self.assign_stack: list[tuple[str | None, ...]] = []
        self.function = "forward"
        self.visiting: set[str] = set()
        #: local names bound to a block list (`blocks = self.blocks`)
        self.aliases: dict[str, str] = {}

    def lists_in(self, node: ast.AST) -> list[str]:
        found = []
        for n in ast.walk(node):
            attr = _self_attr(n)
            if attr in self.lists:
                found.append(attr)
            elif isinstance(n, ast.Name) and n.id in self.aliases:
                found.append(self.aliases[n.id])
        return found

    def list_of(self, node: ast.AST) -> str | None:
        attr = _self_attr(node)
        if attr in self.lists:
            return attr
        return self.aliases.get(node.id) if isinstance(node, ast.Name) else None

    # -- traversal ------------------------------------------------------------------------------------------
    def read(self, name: str, depth: int = 0) -> None:
        fn = getattr(self.cls, name, None)
        if fn is None or name in self.visiting or depth > 3:
            return
        # never read nn.Module's or diffusers' mixins: only code of the model's own classes
        owner = next((k for k in self.cls.__mro__ if name in vars(k)), None)
        if owner is None or owner.__module__.startswith(("torch.", "diffusers.models.modeling_utils")):
            return
        node = _parse(fn)
        if node is None:
            return
        self.visiting.add(name)
        previous, self.function = self.function, name
        for stmt in node.body:
            self.visit(stmt)
        self.function = previous
        self.visiting.discard(name)

    def _tick(self) -> int:
        self.order += 1
        return self.order

    def visit_For(self, node: ast.For) -> None:
        self.visit(node.iter)
        found = self.lists_in(node.iter)
        bound: dict[str, str] = {}
        if found:
            iterable, target = node.iter, node.target
            if _is_call_of(iterable, "enumerate") and isinstance(target, ast.Tuple) and len(target.elts) == 2:
                iterable, target = iterable.args[0], target.elts[1]
            for n in ast.walk(target):
                if isinstance(n, ast.Name):
                    bound[n.id] = found[0]
            if _is_call_of(iterable, "zip") and isinstance(target, ast.Tuple):
                # zip(self.a, self.b): the i-th loop variable is a block of the i-th list
                for elt, arg in zip(target.elts, iterable.args):
                    attr = self.list_of(arg.value if isinstance(arg, ast.Subscript) else arg)
                    if isinstance(elt, ast.Name) and attr is not None:
                        bound[elt.id] = attr
        self.loop_vars.append({**self.loop_vars[-1], **bound})
        self.loops.append(found[0] if found else "")
        self.loop_starts.append(self._tick())
        for stmt in node.body + node.orelse:
            self.visit(stmt)
        self.loops.pop()
        self.loop_starts.pop()
        self.loop_vars.pop()

    def _assign(self, targets: list[ast.AST], value: ast.AST, lineno: int) -> None:
        names = tuple(n for t in targets for n in _target_names(t) if n is not None)
        before = len(self.sites)
        self.assign_stack.append(_target_names(targets[0]) if len(targets) == 1 else (None,))
        self.visit(value)
        self.assign_stack.pop()
        self.assigns.append(_Assign(order=self._tick(), lineno=lineno, names=names, block_call=len(self.sites) > before,
                                    in_loop=any(self.loops)))
        attr = _self_attr(value)
        if attr in self.lists and len(names) == 1:  # `blocks = self.blocks`: an alias of the list
            self.aliases[names[0]] = attr

    def visit_Assign(self, node: ast.Assign) -> None:
        self._assign(node.targets, node.value, node.lineno)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._assign([node.target], node.value, node.lineno)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.visit(node.value)
        self.assigns.append(_Assign(order=self._tick(), lineno=node.lineno, names=_target_names(node.target),
                                    block_call=False, in_loop=any(self.loops)))

    def visit_Call(self, node: ast.Call) -> None:
        attr, args, checkpointed = self._block_call(node)
        if attr is not None:
            self._record(node, attr, args, checkpointed)
        else:
            method = _self_attr(node.func)
            if method is not None and method not in self.lists and callable(getattr(self.cls, method, None)):
                self.read(method, depth=len(self.visiting))
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:  # a nested def (custom_forward) runs where called
        for stmt in node.body:
            self.visit(stmt)

    # -- block calls ----------------------------------------------------------------------------------------
    def _block_call(self, node: ast.Call) -> tuple[str | None, list[ast.AST], bool]:
        loop_vars = self.loop_vars[-1]
        func = node.func
        if isinstance(func, ast.Name) and func.id in loop_vars:
            return loop_vars[func.id], list(node.args), False
        if isinstance(func, ast.Subscript) and self.list_of(func.value) is not None:
            return self.list_of(func.value), list(node.args), False
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if "checkpoint" in name and node.args:
            first = node.args[0]
            if isinstance(first, ast.Name) and first.id in loop_vars:
                return loop_vars[first.id], list(node.args[1:]), True
            if isinstance(first, ast.Subscript) and self.list_of(first.value) is not None:
                return self.list_of(first.value), list(node.args[1:]), True
        return None, [], False

    def _record(self, node: ast.Call, attr: str, args: list[ast.AST], checkpointed: bool) -> None:
        params = self.params[attr]
        passed: dict[str, str | None] = {}
        for i, arg in enumerate(args):
            if isinstance(arg, ast.Starred) or i >= len(params):
                break
            passed[params[i]] = arg.id if isinstance(arg, ast.Name) else None
        for kw in [] if checkpointed else node.keywords:
            if kw.arg is not None:
                passed[kw.arg] = kw.value.id if isinstance(kw.value, ast.Name) else None
        targets = self.assign_stack[-1] if self.assign_stack else ()
        inside = next((loop for loop in reversed(self.loops) if loop and loop != attr), None)
        order = self._tick()
        loop_start = next((start for loop, start in zip(reversed(self.loops), reversed(self.loop_starts))
                           if loop == attr), order)
        self.sites.append(CallSite(attr=attr, order=order, lineno=node.lineno, function=self.function,
                                   passed=passed, targets=targets, inside=inside, checkpointed=checkpointed,
                                   loop_start=loop_start))


def _returned_names(block_cls: type) -> set[tuple[str | None, ...]]:
    """The names each `return` of the block's own forward gives back, per position (nested defs excluded)."""
    node = _parse(block_cls.forward)
    out: set[tuple[str | None, ...]] = set()
    if node is None:
        return out

    def walk(n: ast.AST) -> None:
        for child in ast.iter_child_nodes(n):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(child, ast.Return) and child.value is not None:
                out.add(_target_names(child.value) if isinstance(child.value, (ast.Name, ast.Tuple)) else (None,))
            walk(child)

    walk(node)
    return out


@attrs.define
class _ListFacts:
    attr: str
    first: CallSite
    sites: list[CallSite]
    hidden_var: str | None
    second_var: str | None


def _facts(attr: str, sites: list[CallSite], block_cls: type) -> _ListFacts:
    # prefer a call with keywords: the checkpointed variant passes everything by position
    site = next((s for s in sites if not s.checkpointed and s.targets), None) or next(
        (s for s in sites if s.targets), sites[0])
    passed_vars = {v for v in site.passed.values() if v is not None}
    carried = [t for t in site.targets if t is not None and t in passed_vars]
    hidden = second = None
    if carried:
        # the stream passed to the earliest parameter is the hidden one (every diffusers block takes it first)
        order = {v: i for i, v in enumerate(v for v in site.passed.values())}
        carried.sort(key=lambda v: order.get(v, 99))
        hidden = carried[0]
        second = carried[1] if len(carried) > 1 else None
        meta = _block_metadata(block_cls)
        if second is not None and meta is not None:
            # two streams go in and come back: which one is "hidden" the code does not say; diffusers' entry does
            # when it names exactly these two arguments
            param = {v: p for p, v in site.passed.items() if v is not None}
            if (param.get(second), param.get(hidden)) == (meta.hidden_states_argument_name,
                                                         meta.encoder_hidden_states_argument_name):
                hidden, second = second, hidden
    return _ListFacts(attr=attr, first=min(sites, key=lambda s: s.order), sites=sites, hidden_var=hidden,
                      second_var=second)


def _param_of(site: CallSite, var: str) -> str | None:
    return next((p for p, v in site.passed.items() if v == var), None)


def derive(transformer: torch.nn.Module) -> Derivation:
    """Read the transformer's code into an adapter (see the module docstring), or raise `AdapterError`."""
    cls = type(transformer)
    cls_name = cls.__name__
    lists = _block_lists(transformer)
    left_out: dict[str, str] = {}
    notes: list[str] = []
    mixed = {a for a, ml in lists.items() if len({type(m) for m in ml}) != 1}
    reader = _Reader(cls, {a: ml for a, ml in lists.items() if a not in mixed})
    reader.read("forward")
    by_attr: dict[str, list[CallSite]] = {}
    for site in reader.sites:
        by_attr.setdefault(site.attr, []).append(site)
    for attr in lists:
        if attr in mixed:
            left_out[attr] = "holds modules of several classes (not one repeated block)"
        elif attr not in by_attr:
            left_out[attr] = f"{cls_name}.forward calls none of its modules in a way hookkit can read"
    facts = sorted((_facts(a, s, type(lists[a][0])) for a, s in by_attr.items()), key=lambda f: f.first.order)
    for f in facts:
        if f.first.inside is not None:
            left_out[f.attr] = (f"runs inside the loop over {f.first.inside} (line {f.first.lineno}), between its "
                                "blocks: not a stage of the block chain")
        elif f.hidden_var is None:
            left_out[f.attr] = (f"its calls carry no stream from one module to the next (line {f.first.lineno}): "
                                "not a chain of blocks")
    chain = [f for f in facts if f.attr not in left_out]
    if not chain:
        raise AdapterError(
            f"no adapter for {cls_name} and none can be derived from its code: no nn.ModuleList whose blocks "
            f"{cls_name}.forward calls in a chain ({'; '.join(f'{a}: {r}' for a, r in left_out.items()) or 'none'}). "
            + CUSTOM_ADAPTER_HELP
        )
    main_var = chain[-1].hidden_var
    for f in chain:
        if f.hidden_var != main_var:
            left_out[f.attr] = (f"runs on `{f.hidden_var}`, not on `{main_var}`, the stream the last blocks carry "
                                "(a refiner or side stage; it always runs)")
    chain = [f for f in chain if f.attr not in left_out]
    # the hidden stream rebuilt between two lists (a concatenation, a padded joint sequence): what runs before it
    # is a stage of its own, always computed
    for i in range(len(chain) - 1, 0, -1):
        end = max(s.order for s in chain[i - 1].sites)
        start = chain[i].first.order
        loop_start = chain[i].first.loop_start
        # outside any loop, or inside the later list's own loop before its first block call (BriaFibo concatenates
        # the streams at the top of every single-block iteration); not a change inside the earlier list's loop
        rebuilt = [a for a in reader.assigns
                   if end < a.order < start and main_var in a.names and not a.block_call
                   and (not a.in_loop or a.order > loop_start)]
        if rebuilt:
            for f in chain[:i]:
                left_out[f.attr] = (f"runs before {cls_name}.forward rebuilds `{main_var}` (line {rebuilt[0].lineno}, "
                                    f"before {chain[i].attr}): a stage before the cached chain; it always runs")
            chain = chain[i:]
            break
    blocks = []
    for f in chain:
        blocks.append(_block_spec(cls_name, f, lists[f.attr], notes))
    declared = getattr(transformer, "_repeated_blocks", None) or ()
    present = {type(m).__name__ for m in transformer.modules()}
    repeated = tuple(c for c in ((declared,) if isinstance(declared, str) else declared) if c in present)
    if not repeated:
        # every list that runs as repeated blocks (left-out refiner stages included) is a compile region
        repeated = tuple(dict.fromkeys(type(lists[a][0]).__name__ for a in by_attr if a not in mixed
                                       and not left_out.get(a, "").startswith(("runs inside", "its calls carry"))))
    adapter = AdapterSpec(
        name=f"derived:{cls_name}", transformer=(cls_name,), blocks=tuple(blocks), repeated_blocks=repeated,
        left_out=left_out, notes=tuple(notes), diffusers_metadata="ignore", source="derived from the model's code",
    )
    return Derivation(adapter=adapter, left_out=left_out, notes=tuple(notes))


def _block_spec(cls_name: str, f: _ListFacts, modules: torch.nn.ModuleList, notes: list[str]) -> BlockListSpec:
    block_cls = type(modules[0])
    name = block_cls.__name__
    site = next((s for s in f.sites if not s.checkpointed and s.targets), None) or f.first
    hidden_arg = _param_of(site, f.hidden_var)
    encoder_arg = _param_of(site, f.second_var) if f.second_var else None
    targets = site.targets
    returns: list[str] = []
    for t in targets:
        if t == f.hidden_var:
            returns.append("hidden_states")
        elif f.second_var is not None and t == f.second_var:
            returns.append("encoder_hidden_states")
        else:
            raise AdapterError(
                f"{cls_name}.{f.attr} ({name}): line {site.lineno} assigns the block's result to {list(targets)}; "
                f"position {len(returns)} is neither the hidden stream `{f.hidden_var}` nor a second stream it "
                "passes in. hookkit cannot name it. Write an adapter for it: " + CUSTOM_ADAPTER_HELP
            )
    if hidden_arg is None:
        raise AdapterError(f"{cls_name}.{f.attr} ({name}): the call at line {site.lineno} passes `{f.hidden_var}` to "
                           "no parameter hookkit can name. " + CUSTOM_ADAPTER_HELP)
    # the block's own return statements must agree with the call site, position by position
    arg_of = {hidden_arg: "hidden_states", **({encoder_arg: "encoder_hidden_states"} if encoder_arg else {})}
    for returned in _returned_names(block_cls):
        if len(returned) != len(returns) or None in returned:
            continue  # another return shape (an early exit) or an expression: nothing to compare
        streams = [arg_of.get(n) for n in returned]
        if all(s is not None for s in streams) and streams != returns:
            toml = _toml_block(f.attr, name, hidden_arg, encoder_arg, streams)
            raise AdapterError(
                f"{name}.forward returns {list(returned)} ({streams}), but {cls_name}.forward (line {site.lineno}) "
                f"unpacks it as {list(targets)} ({returns}): ambiguous, hookkit will not guess. Check which is "
                f"right and register an adapter with, e.g.:\n{toml}"
            )
    long_skips = any(p in SKIP_ARGS for s in f.sites for p, v in s.passed.items() if v is not None)
    spec = BlockListSpec(attr=f.attr, classes=(name,), hidden_arg=hidden_arg, encoder_arg=encoder_arg,
                         returns=tuple(returns), long_skips=long_skips)
    meta = _block_metadata(block_cls)
    if meta is not None:
        registered = _registered_returns(meta)
        if registered != list(spec.returns):
            notes.append(f"diffusers registers {name} as returning {registered}; its code returns {list(spec.returns)} "
                         f"({cls_name}.forward line {site.lineno}): the code is used")
        if meta.hidden_states_argument_name != hidden_arg:
            notes.append(f"diffusers registers {name}'s hidden argument as {meta.hidden_states_argument_name!r}; its "
                         f"forward takes {hidden_arg!r}: the code is used")
        if encoder_arg is not None and meta.encoder_hidden_states_argument_name != encoder_arg:
            notes.append(f"diffusers registers {name}'s encoder argument as {meta.encoder_hidden_states_argument_name!r}; "
                         f"the second stream it returns is {encoder_arg!r}: the code is used")
    return spec


def _toml_block(attr: str, name: str, hidden: str, encoder: str | None, returns: list[Any]) -> str:
    lines = ["[[blocks]]", f'attr = "{attr}"', f'class = "{name}"', f'hidden_arg = "{hidden}"']
    if encoder:
        lines.append(f'encoder_arg = "{encoder}"')
    lines.append("returns = [" + ", ".join(f'"{r}"' for r in returns) + "]")
    return "\n".join(lines)


def derive_adapter(transformer: torch.nn.Module) -> AdapterSpec:
    """The adapter derived from `transformer`'s code (see `derive`), or `AdapterError`."""
    return derive(transformer).adapter


def transformer_class(name: str, *, trust_remote_code: bool = False, source: str = "") -> type:
    """The class `name` names, for `hookkit adapter derive`: a bare name or a dotted path of a class diffusers ships is
    looked up by its name on `diffusers` (or `diffusers.models`), which loads only diffusers' own modules. Any other
    dotted path is imported only with `trust_remote_code=True`: importing a module runs its code, and a model folder's
    `config.json` naming a package shipped next to it is no reason to run that package.

    Args:
        name: "FluxTransformer2DModel", "diffusers.models.transformers.transformer_flux.FluxTransformer2DModel" or
            "pkg.module.Class".
        trust_remote_code: import a dotted path outside diffusers (CLI: `--trust-remote-code`). Default False.
        source: where `name` came from, for the error ("the _class_name of model/config.json"); default the argument.
    """
    import importlib

    import diffusers

    module_name, _, cls_name = name.rpartition(".")
    cls: Any = None
    in_diffusers = not module_name or module_name == "diffusers" or module_name.startswith("diffusers.")
    if in_diffusers:
        for namespace in (diffusers, diffusers.models):
            try:
                cls = getattr(namespace, cls_name, None)
            except Exception:  # noqa: BLE001 - diffusers' lazy module failing to load its own submodule
                cls = None
            if cls is not None:
                break
        if module_name not in ("", "diffusers", "diffusers.models") and getattr(cls, "__module__", None) != module_name:
            cls = None  # a same-named class elsewhere in diffusers is not the one the path names
    elif not trust_remote_code:
        as_source = f" as {source}" if source else ""
        raise AdapterError(
            f"adapter derive: expected a class diffusers ships{as_source}, got {name!r}: reading it would import the "
            f"module {module_name!r} and run its code; nothing was imported. If you trust that code, pass "
            "--trust-remote-code (in Python: transformer_class(..., trust_remote_code=True)).")
    if cls is None and module_name and trust_remote_code:  # trusted: any module, diffusers' unexported ones too
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError):
            cls = None
    if cls is None:
        raise AdapterError(f"adapter derive: expected a diffusers transformer class name (e.g. ZImageTransformer2DModel), "
                           f"a dotted path pkg.module.Class or a model folder, got {name!r}, which names no class.")
    return cls


def adapter_toml(adapter: AdapterSpec) -> str:
    """`adapter` as a TOML file `register_adapter` reads back to an equal adapter (notes become comments)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return str(v)

    lines = [f"# {adapter.name}: {adapter.source}"]
    lines += [f"# note: {n}" for n in adapter.notes]
    lines += [f"name = {value(adapter.name)}", f"transformer = {value(adapter.transformer)}"]
    if adapter.pipelines:
        lines.append(f"pipelines = {value(adapter.pipelines)}")
    lines += [f"cfg = {value(adapter.cfg)}", f"memo_scope = {value(adapter.memo_scope)}",
              f"repeated_blocks = {value(adapter.repeated_blocks)}", f"quant_exclude = {value(adapter.quant_exclude)}"]
    if adapter.notes:
        lines.append(f"notes = {value(adapter.notes)}")
    if adapter.diffusers_metadata != "check":
        lines.append(f"diffusers_metadata = {value(adapter.diffusers_metadata)}")
    if adapter.cp_plan_override:
        lines.append("cp_plan_override = true")
    if adapter.host_syncs:
        lines.append(f"host_syncs = {value(adapter.host_syncs)}")
    for block in adapter.blocks:
        lines += ["", "[[blocks]]", f"attr = {value(block.attr)}",
                  f"class = {value(block.classes[0] if len(block.classes) == 1 else block.classes)}",
                  f"hidden_arg = {value(block.hidden_arg)}"]
        if block.encoder_arg is not None:
            lines.append(f"encoder_arg = {value(block.encoder_arg)}")
        lines.append(f"returns = {value(block.returns)}")
        if block.long_skips:
            lines.append("long_skips = true")
    for entry in adapter.cp_plan:
        lines += ["", "[[cp_plan]]", f"module = {value(entry.module)}"]
        if entry.split:
            tables = [", ".join(f"{k} = {value(v)}" for k, v in (("input", s.input), ("output", s.output),
                                                                  ("split_dim", s.split_dim),
                                                                  ("expected_dims", s.expected_dims)) if v is not None)
                      for s in entry.split]
            lines.append("split = [" + ", ".join("{ " + t + " }" for t in tables) + "]")
        if entry.gather:
            tables = [", ".join(f"{k} = {value(v)}" for k, v in (("gather_dim", g.gather_dim),
                                                                  ("expected_dims", g.expected_dims)) if v is not None)
                      for g in entry.gather]
            lines.append("gather = [" + ", ".join("{ " + t + " }" for t in tables) + "]")
    if adapter.left_out:
        lines += ["", "[left_out]"] + [f"{attr} = {value(reason)}" for attr, reason in adapter.left_out]
    return "\n".join(lines) + "\n"
