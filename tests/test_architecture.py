"""The layout as tests: what `import hookkit` loads, who may import whom, the feature table, the compat table,
and the handle as a context manager."""

from __future__ import annotations

import ast
import re
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import hookkit
from hookkit.core import compat
from hookkit.core.feature import BaseFeature, FeatureTable
from hookkit.core.graphs import GraphDecisions
from hookkit.core.registry import registry_names
from hookkit.errors import HookError, SpecError
from hookkit.features import FEATURES
from hookkit.tools import zoo

PACKAGE = Path(hookkit.__file__).parent
TECHNIQUES = ("attention", "cache", "compile", "memo", "parallel", "quantize", "sync_free")


# --- what `import hookkit` loads ------------------------------------------------------------------------


def test_import_hookkit_loads_no_tooling() -> None:
    code = (
        "import sys, hookkit\n"
        "prefixes = ('hookkit.tools', 'matplotlib', 'diffusers.pipelines', 'torchao', 'resource')\n"
        "print(sorted(m for m in sys.modules if m.startswith(prefixes)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=PACKAGE.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


# --- the import graph -----------------------------------------------------------------------------------


def imports_of(source: str, module: str) -> list[str]:
    """Every hookkit name `source` imports, nested, function-local and `TYPE_CHECKING` imports included: a type
    hint names a dependency as much as a runtime import does. `from a import b` gives `a.b`."""
    package = module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] if base.startswith("hookkit") else [base]
        else:
            continue
        out += [name for name in names if name == "hookkit" or name.startswith("hookkit.")]
    return out


def technique_of(module: str) -> str | None:
    parts = module.split(".")
    found = parts[2] if len(parts) > 2 and parts[:2] == ["hookkit", "techniques"] else None
    return None if found == "__init__" else found  # the package's own __init__ is no technique


def is_spec_module(module: str) -> bool:
    """`hookkit.spec` and each technique's spec module: the data layer that `hookkit.Spec` composes."""
    return module == "hookkit.spec" or (technique_of(module) is not None and module.endswith(".spec"))


#: what a spec module may import: validators, errors, other spec modules, the cache's calibration data and the
#: quantization's layer predicates (data with a text form, read back by `filters.parse`)
SPEC_IMPORTS = ("hookkit.core.validate", "hookkit.errors", "hookkit.techniques.cache.calibration",
                "hookkit.techniques.quantize.filters")


def violations(module: str, source: str) -> list[str]:
    """The layering rules broken by `module`: techniques import no other technique, no `core.handle`, no
    composition layer and no tooling; the core imports no technique, no composition layer and no tooling. Neither
    imports `hookkit.spec`, not even for type hints: it composes every technique's spec. A spec module imports no
    hooks: only validators, errors and other specs."""
    out = []
    own = technique_of(module)
    for name in imports_of(source, module):
        other = technique_of(name)
        if own is not None:
            if other is not None and other != own:
                out.append(f"{module} imports technique {name}")
            if name.startswith(("hookkit.core.handle", "hookkit.features", "hookkit.tools", "hookkit.spec")):
                out.append(f"{module} imports {name}")
        if module.startswith("hookkit.core."):
            if other is not None or name.startswith(("hookkit.features", "hookkit.tools", "hookkit.spec")):
                out.append(f"{module} imports {name}")
        if is_spec_module(module) and not (name.startswith(SPEC_IMPORTS) or is_spec_module(name.rpartition(".")[0])):
            out.append(f"{module} imports {name} (a spec imports only validators, errors and other specs)")
    return out


def package_modules() -> dict[str, str]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name if parts[-1] != "__init__" else f"{name}.__init__"] = path.read_text()
    return out


def test_no_technique_imports_another_and_the_core_imports_none() -> None:
    modules = package_modules()
    assert {technique_of(m) for m in modules} - {None} == set(TECHNIQUES)
    assert [v for module, source in modules.items() for v in violations(module, source)] == []


@pytest.mark.parametrize("module, source, expected", [
    ("hookkit.techniques.compile.hooks", "from hookkit.techniques.cache.hooks import graph_bridge",
     ["hookkit.techniques.compile.hooks imports technique hookkit.techniques.cache.hooks.graph_bridge"]),
    ("hookkit.techniques.sync_free", "def f():\n    from hookkit.core.handle import SchedulerListener",
     ["hookkit.techniques.sync_free imports hookkit.core.handle.SchedulerListener"]),
    ("hookkit.core.plan", "from hookkit.spec import Spec", ["hookkit.core.plan imports hookkit.spec.Spec"]),
    ("hookkit.core.plan", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hookkit.spec import Spec",
     ["hookkit.core.plan imports hookkit.spec.Spec"]),
    ("hookkit.techniques.memo", "from hookkit.spec import Spec", ["hookkit.techniques.memo imports hookkit.spec.Spec"]),
    ("hookkit.core.handle", "import hookkit.techniques.memo", ["hookkit.core.handle imports hookkit.techniques.memo"]),
    ("hookkit.techniques.cache.hooks", "from .spec import DBCache", []),
    ("hookkit.techniques.cache.hooks", "from ..memo import MemoMode",
     ["hookkit.techniques.cache.hooks imports technique hookkit.techniques.memo.MemoMode"]),
    ("hookkit.spec", "from hookkit.techniques.parallel.spec import ContextParallel", []),
    ("hookkit.spec", "from hookkit.techniques.parallel.hooks import ContextParallel",
     ["hookkit.spec imports hookkit.techniques.parallel.hooks.ContextParallel (a spec imports only validators, "
      "errors and other specs)"]),
    ("hookkit.techniques.parallel.spec", "from hookkit.core.feature import BaseFeature",
     ["hookkit.techniques.parallel.spec imports hookkit.core.feature.BaseFeature (a spec imports only validators, "
      "errors and other specs)"]),
])
def test_the_import_graph_check_catches_each_kind_of_violation(module: str, source: str, expected: list[str]) -> None:
    assert violations(module, source) == expected


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the hookkit modules it imports (`imports_of`: every import, type-only and function-local ones
    too). `from a import b` counts `a.b` when that is a module, else `a`. Importing `a.b` also runs `a/__init__`;
    that edge is left out, else every module would import `hookkit/__init__` (the public API, which by design
    imports most of the package)."""
    names = {m.removesuffix(".__init__"): m for m in modules}

    def resolve(name: str) -> str:
        while name not in names:
            name = name.rpartition(".")[0]
        return name

    return {module.removesuffix(".__init__"): {resolve(name) for name in imports_of(source, module)}
            - {module.removesuffix(".__init__")} for module, source in modules.items()}


def first_cycle(graph: dict[str, set[str]]) -> list[str]:
    """The first import cycle found, visiting modules in sorted order (`[a, b, ..., a]`), or [] when there is none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str]:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return []
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if cycle := visit(imported):
                return cycle
        path.pop()
        done.add(module)
        return []

    for module in sorted(graph):
        if cycle := visit(module):
            return cycle
    return []


def test_the_package_has_no_import_cycle() -> None:
    cycle = first_cycle(import_graph(package_modules()))
    assert cycle == [], "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("modules, expected", [
    ({"hookkit.a": "import hookkit.b", "hookkit.b": "from hookkit import c", "hookkit.c": ""}, []),
    ({"hookkit.a": "from hookkit.b import f", "hookkit.b": "def g():\n    from hookkit.a import h"},
     ["hookkit.a", "hookkit.b", "hookkit.a"]),
    ({"hookkit.a": "from hookkit.b import f",
      "hookkit.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hookkit.c import T",
      "hookkit.c": "from . import a"},
     ["hookkit.a", "hookkit.b", "hookkit.c", "hookkit.a"]),
    ({"hookkit.__init__": "from hookkit.x.y import f", "hookkit.x.__init__": "", "hookkit.x.y": "import hookkit"},
     ["hookkit", "hookkit.x.y", "hookkit"]),
])
def test_the_cycle_check_counts_function_local_and_type_only_imports(modules: dict[str, str],
                                                                     expected: list[str]) -> None:
    assert first_cycle(import_graph(modules)) == expected


# --- the feature table ----------------------------------------------------------------------------------


def test_shipped_features_are_keyed_by_spec_field_in_attach_order() -> None:
    assert list(FEATURES) == ["quantize", "parallel", "memo", "sync_free", "cache", "attention", "compile"]
    assert all(FEATURES[name].name == name for name in FEATURES)


class _Good(BaseFeature):
    name = "memo"
    spec_class = bool

    def plan(self, ctx: Any) -> list[Any]:
        return []

    def attach(self, ctx: Any, attachment: Any) -> Any:
        raise AssertionError("never attached")


class _NoName(_Good):
    name = "turbo"  # type: ignore[assignment]


class _WrongSpecClass(_Good):
    name = "cache"
    spec_class = hookkit.Quantize


class _NoAttach(BaseFeature):
    name = "memo"
    spec_class = bool

    def plan(self, ctx: Any) -> list[Any]:
        return []


class _AttachWithoutAttachment(_Good):
    def attach(self, ctx: Any) -> Any:  # type: ignore[override]
        return None


@pytest.mark.parametrize("features, message", [
    ([_NoName()], r"^hookkit feature test_architecture._NoName: name expected one of the Spec fields \['attention', "
                  r"'cache', 'compile', 'memo', 'parallel', 'quantize', 'sync_free'\], got 'turbo' \(a feature implements exactly one Spec "
                  r"field and is named after it\). Set `name`.$"),
    ([_WrongSpecClass()], r"^hookkit feature test_architecture._WrongSpecClass \('cache'\): spec_class expected the "
                          r"type of Spec.cache \(DBCache\), got <class 'hookkit.techniques.quantize.spec.Quantize'>"),
    ([_NoAttach()], r"^hookkit feature test_architecture._NoAttach \('memo'\): attach expected a method, got None"),
    ([_AttachWithoutAttachment()], r"\('memo'\): attach expected 2 argument\(s\) after self, got 1 \(ctx\)"),
    ([_Good(), _Good()], r"^hookkit feature _Good: name 'memo' expected once in the table, got it a second time"),
])
def test_a_malformed_feature_is_refused_at_registration(features: list[Any], message: str) -> None:
    with pytest.raises(HookError, match=message):
        FeatureTable(hookkit.Spec, features)


def test_a_well_formed_feature_is_registered() -> None:
    feature = _Good()
    assert FeatureTable(hookkit.Spec, [feature])["memo"] is feature


# --- the compat table -----------------------------------------------------------------------------------

WHOLE = hookkit.Compile(regional=False)
GRAPHS = hookkit.Compile(cuda_graphs="transformer")
STATIC = hookkit.DBCache(steps_mask="fast", mask_policy="static", taylorseer_order=0)
SETTINGS: dict[str, Any] = {
    "quantize": hookkit.Quantize(scheme="int8_weight_only"), "memo": True, "sync_free": True,
    "cache": hookkit.DBCache(), "compile": hookkit.Compile(), "parallel": hookkit.ContextParallel(ulysses=2),
    "attention": hookkit.Attention(),
}
#: pairs refused whatever their settings
REFUSED_PAIRS: tuple[set[str], ...] = ()

#: (adapter, spec fields, expected): "allowed", ("refused", error, message start), ("inactive", feature, reason start)
COMPAT_CASES: list[tuple[str, dict[str, Any], Any]] = [
    *[("flux", {a: SETTINGS[a], b: SETTINGS[b]}, "allowed") for a, b in itertools.combinations(SETTINGS, 2)
      if {a, b} not in REFUSED_PAIRS],
    ("flux", {"attention": SETTINGS["attention"], "parallel": hookkit.ContextParallel(ring=2)},
     ("refused", SpecError, "Spec.attention: expected ContextParallel with ring=1 and attention_backend None or "
                            "'native'")),
    ("flux", {"attention": SETTINGS["attention"], "parallel": hookkit.ContextParallel(
        ulysses=2, attention_backend="_native_cudnn")},
     ("refused", SpecError, "Spec.attention: expected ContextParallel with ring=1 and attention_backend None or "
                            "'native'")),
    ("hunyuanvideo15", {"compile": GRAPHS},  # its adapter's host_syncs: no capture could succeed
     ("refused", SpecError, "Compile.cuda_graphs: expected 'none' on 'hunyuanvideo15', whose forward waits for the "
                            "host outside its blocks")),
    ("flux", {"attention": SETTINGS["attention"], "compile": GRAPHS}, "allowed"),  # graphs keyed by the step's kernel
    ("flux", {"attention": SETTINGS["attention"], "cache": STATIC, "compile": GRAPHS}, "allowed"),
    ("flux", {"attention": SETTINGS["attention"], "compile": WHOLE},
     ("refused", SpecError, "Spec.compile: expected Compile(regional=True) with Attention")),
    ("flux", {"attention": SETTINGS["attention"], "cache": hookkit.DBCache(threshold=0.2, taylorseer_order=0),
              "compile": GRAPHS},
     ("refused", SpecError, "Spec.attention: expected None with Compile(cuda_graphs='transformer') and a DBCache "
                            "threshold decided at each call")),
    ("flux", {"cache": SETTINGS["cache"], "compile": WHOLE},
     ("refused", SpecError, "Compile.regional: expected True with DBCache")),
    ("flux", {"cache": hookkit.DBCache(threshold=0.24), "compile": GRAPHS},
     ("refused", SpecError, "DBCache.taylorseer_order: expected 0 with Compile(cuda_graphs='transformer')")),
    ("flux", {"cache": SETTINGS["cache"], "compile": GRAPHS}, "allowed"),  # the default plans before the call
    ("flux", {"cache": STATIC, "compile": GRAPHS}, "allowed"),
    ("flux", {"cache": attrs.evolve(STATIC, taylorseer_order=2), "compile": GRAPHS}, "allowed"),  # decided before the call
    ("flux", {"cache": hookkit.DBCache(threshold=0.2, taylorseer_order=0), "compile": GRAPHS}, "allowed"),  # split graphs
    ("flux", {"memo": True, "compile": WHOLE},
     ("inactive", "memo", "Compile(regional=False) compiles the prologue itself")),
    ("qwenimage", {"compile": GRAPHS},
     ("refused", SpecError, "Spec.memo: expected True with Compile(cuda_graphs='transformer') on 'qwenimage'")),
    ("qwenimage", {"memo": True, "compile": GRAPHS}, "allowed"),
    ("flux", {"compile": GRAPHS}, "allowed"),  # Flux's prologue builds no tensors from Python data
]


@pytest.mark.parametrize("adapter, fields, expected", COMPAT_CASES,
                         ids=[f"{a}-{'+'.join(f)}-{e if isinstance(e, str) else e[0]}" for a, f, e in COMPAT_CASES])
def test_compat_table(adapter: str, fields: dict[str, Any], expected: Any) -> None:
    spec, found = hookkit.Spec(**fields), hookkit.get_adapter(adapter)
    applied = compat.outcome(spec, found)
    if expected == "allowed":
        assert applied == []
        compat.check(spec, found)
    elif expected[0] == "refused":
        _, error, start = expected
        assert [(r.outcome, m.startswith(start)) for r, m in applied] == [("refused", True)]
        with pytest.raises(error) as info:
            compat.check(spec, found)
        assert str(info.value).startswith(start)
    else:
        _, feature, start = expected
        compat.check(spec, found)
        reason = compat.inactive_reason(feature, spec, found)
        assert reason is not None and reason.startswith(start)


def test_every_pair_of_features_has_a_compat_case() -> None:
    pairs = {frozenset(fields) for _, fields, _ in COMPAT_CASES}
    assert {frozenset(p) for p in itertools.combinations(FEATURES, 2)} <= pairs


def test_every_rule_of_the_compat_table_has_a_case() -> None:
    hit = {id(r) for adapter, fields, _ in COMPAT_CASES
           for r, _ in compat.outcome(hookkit.Spec(**fields), hookkit.get_adapter(adapter))}
    assert hit == {id(r) for r in compat.RULES}


def test_enable_applies_the_compat_table_before_attaching_anything() -> None:
    pipe = zoo.tiny_pipeline("flux")
    with pytest.raises(SpecError, match=r"^Compile.regional: expected True with DBCache"):
        hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(), compile=WHOLE))
    assert registry_names(pipe.transformer) == () and "step" not in pipe.scheduler.__dict__


# --- the handle ------------------------------------------------------------------------------------------


def run(pipe: Any) -> torch.Tensor:
    return pipe(**zoo.call_kwargs("flux", steps=2)).images


def test_handle_is_a_context_manager_that_removes_everything_on_exit() -> None:
    pipe = zoo.tiny_pipeline("flux")
    reference = run(pipe)
    before = {path: set(m.__dict__) for path, m in pipe.transformer.named_modules()}
    with hookkit.enable(pipe, hookkit.Spec(cache=STATIC)) as handle:
        assert hookkit.handle_of(pipe) is handle
        run(pipe)
    assert handle.removed and hookkit.handle_of(pipe) is None
    assert {path: set(m.__dict__) for path, m in pipe.transformer.named_modules()} == before
    assert "step" not in pipe.scheduler.__dict__ and torch.equal(run(pipe), reference)


def test_handle_context_removes_everything_when_the_block_raises() -> None:
    pipe = zoo.tiny_pipeline("flux")
    with pytest.raises(KeyError, match="inside"):
        with hookkit.enable(pipe, hookkit.Spec(memo=True)):
            raise KeyError("inside")
    assert hookkit.handle_of(pipe) is None and registry_names(pipe.transformer) == ()


def test_handle_repr_names_the_model_the_features_and_the_state() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(cache=STATIC, sync_free=True))
    run(pipe)
    n = len(handle.plan.attachments)
    assert repr(handle) == (f"<hookkit.Handle FluxTransformer2DModel on FluxPipeline, adapter 'flux', features "
                            f"[sync_free, cache], {n} attachments, 1 generations>")
    handle.remove()
    assert repr(handle) == ("<hookkit.Handle FluxTransformer2DModel on FluxPipeline, adapter 'flux', features "
                            "[sync_free, cache], removed, 1 generations>")


def test_a_bare_transformer_handle_repr_has_no_pipeline() -> None:
    transformer = zoo.tiny_pipeline("flux").transformer
    handle = hookkit.enable(transformer)
    assert repr(handle) == "<hookkit.Handle FluxTransformer2DModel, adapter 'flux', features [none], 1 attachments, " \
                           "0 generations>"
    handle.remove()


def test_the_cache_provides_graph_decisions_to_later_features_and_removal_drops_them() -> None:
    pipe = zoo.tiny_pipeline("flux")
    assert hookkit.enable(zoo.tiny_pipeline("flux"), hookkit.Spec(memo=True)).service(GraphDecisions) is None
    handle = hookkit.enable(pipe, hookkit.Spec(cache=STATIC))
    decisions = handle.service(GraphDecisions)
    assert isinstance(decisions, GraphDecisions) and handle.service(GraphDecisions) is decisions
    handle.remove()
    assert handle.service(GraphDecisions) is None


def test_feature_state_lives_in_the_handle_slot_and_is_dropped_at_removal() -> None:
    pipe = zoo.tiny_pipeline("flux")
    handle = hookkit.enable(pipe, hookkit.Spec(sync_free=True, cache=STATIC))
    assert sorted(handle._slots) == ["cache", "sync_free"]
    handle.remove()
    assert handle._slots == {}


# --- one name per technique, and the docs ----------------------------------------------------------------


def test_one_name_per_technique_for_spec_field_feature_hooks_and_summary() -> None:
    pipe = zoo.tiny_pipeline("flux")
    spec = hookkit.Spec(quantize=hookkit.Quantize(scheme="int8_weight_only", keep_original="cpu"), memo=True,
                        sync_free=True, cache=STATIC, compile=hookkit.Compile(backend="eager"),
                        attention=hookkit.Attention(low_precision="_native_math"))
    with hookkit.enable(pipe, spec) as handle:
        summary = handle.summary()
        # every feature but context parallelism, which needs a process group (tests/test_parallel.py runs it)
        fields = {f.name for f in attrs.fields(hookkit.Spec)}
        assert set(summary.features) == set(FEATURES) - {"parallel"} == fields - {"parallel"}
        assert {a.feature for a in handle.plan.attachments} == {"core", *FEATURES} - {"memo", "parallel"}
        assert [a.name for a in handle.plan.attachments if a.feature != "core"
                and not a.name.startswith(f"hookkit.{a.feature}")] == []


SPEC_CLASSES = [hookkit.Spec, hookkit.DBCache, hookkit.Quantize, hookkit.Compile, hookkit.ContextParallel,
                hookkit.Attention]


@pytest.mark.parametrize("cls", SPEC_CLASSES, ids=[c.__name__ for c in SPEC_CLASSES])
def test_every_spec_field_has_an_args_entry(cls: type) -> None:
    doc = cls.__doc__ or ""
    args = doc[doc.index("Args:"):]
    assert [f.name for f in attrs.fields(cls) if f"\n        {f.name}: " not in args] == []


#: what cites the work that made a number instead of what is measured, or the number itself (numbers live in
#: BENCHMARKS.md): a numbered seed, session, run or issue, seconds with decimals; `--runs 5` is a flag, not history
HISTORY = re.compile(r"seed[ -]0\d\d|\bsession \d+|(?<!-)\bruns? \d+|\bissue \d+|\d+\.\d+ s\b", re.IGNORECASE)


@pytest.mark.parametrize("doc, cites_history", [
    ("as measured in session 8", True), ("(BENCHMARKS.md, run 7)", True), ("the measure of runs 1-19", True),
    ("since run 26 the pass leaves 40 heads", True), ("seed-003's table", True), ("issue 12", True),
    ("3.81 s measured", True), ("python x.py --runs 5", False), ("median of --runs replays", False),
    ("28 steps, 2 runs: a fast check", False),
])
def test_the_history_pattern_tells_history_from_what_a_script_measures(doc: str, cites_history: bool) -> None:
    assert bool(HISTORY.search(doc)) is cites_history


def test_module_docstrings_are_at_most_20_lines_and_carry_no_session_history() -> None:
    long, history = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if len(doc.strip("\n").splitlines()) > 20:
            long.append(path.name)
        if HISTORY.search(doc):
            history.append(path.name)
    assert (long, history) == ([], [])


def test_benchmark_scripts_module_and_function_docstrings_carry_no_history() -> None:
    history = []
    for path in sorted((PACKAGE.parent / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
            if HISTORY.search(ast.get_docstring(node, clean=False) or ""):
                history.append(f"{path.name}:{getattr(node, 'name', '<module>')}")
    assert history == []
