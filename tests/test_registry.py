"""The hook core: ordered named hooks per module, exact restoration, no leaks."""

from __future__ import annotations

import copy
import gc
import inspect
import weakref

import pytest
import torch

from hookkit.errors import HookError
from hookkit.core.registry import HookRegistry, ModelHook, registry_names


class Recorder(ModelHook):
    def __init__(self, tag: str, log: list[str]) -> None:
        self.tag, self.log = tag, log

    def pre_forward(self, module, args, kwargs):
        self.log.append(f"pre:{self.tag}")
        return args, kwargs

    def post_forward(self, module, output):
        self.log.append(f"post:{self.tag}")
        return output


class AddOne(ModelHook):
    def post_forward(self, module, output):
        return output + 1


class Skip(ModelHook):
    """Replaces the call: returns the input unchanged without running the module."""

    replaces_forward = True

    def new_forward(self, module, call_next, args, kwargs):
        return args[0]


def linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)


def test_hooks_run_in_registry_order_outermost_first() -> None:
    log: list[str] = []
    m = linear()
    reg = HookRegistry.of(m)
    reg.register("a", Recorder("a", log))
    reg.register("b", Recorder("b", log))
    m(torch.ones(1, 4))
    assert reg.names == ("a", "b")
    assert log == ["pre:a", "pre:b", "post:b", "post:a"]


def test_position_inserts_anywhere_in_the_chain() -> None:
    m = linear()
    reg = HookRegistry.of(m)
    for name in ("a", "c"):
        reg.register(name, ModelHook())
    reg.register("b", ModelHook(), position=1)
    reg.register("first", ModelHook(), position=0)
    assert reg.names == ("first", "a", "b", "c")


def test_duplicate_name_is_an_error_that_says_how_to_fix_it() -> None:
    reg = HookRegistry.of(linear())
    reg.register("a", ModelHook())
    with pytest.raises(HookError, match=r"'a' is already registered .*Remove it first"):
        reg.register("a", ModelHook())


def test_remove_from_the_middle_keeps_the_others_in_order() -> None:
    log: list[str] = []
    m = linear()
    reg = HookRegistry.of(m)
    for tag in "abc":
        reg.register(tag, Recorder(tag, log))
    reg.remove("b")
    m(torch.ones(1, 4))
    assert reg.names == ("a", "c")
    assert log == ["pre:a", "pre:c", "post:c", "post:a"]


def test_removing_an_unknown_name_names_the_existing_hooks() -> None:
    reg = HookRegistry.of(linear())
    reg.register("a", ModelHook())
    with pytest.raises(HookError, match=r"no hook named 'zz' \(hooks: \['a'\]\)"):
        reg.remove("zz")


def test_post_forward_replaces_the_output() -> None:
    m = linear()
    x = torch.ones(1, 4)
    ref = m(x)
    HookRegistry.of(m).register("add", AddOne())
    assert torch.equal(m(x), ref + 1)


def test_new_forward_can_skip_the_module() -> None:
    m = linear()
    x = torch.randn(1, 4)
    HookRegistry.of(m).register("skip", Skip())
    assert m(x) is x


def test_removing_the_last_hook_restores_the_module_exactly() -> None:
    m = linear()
    before = dict(m.__dict__)
    reg = HookRegistry.of(m)
    reg.register("a", ModelHook())
    reg.register("b", AddOne())
    assert set(m.__dict__) - set(before) == {"forward", "_hookkit_registry", "__getstate__"}
    reg.remove("a")
    reg.remove("b")
    assert m.__dict__ == before
    assert m.forward.__func__ is torch.nn.Linear.forward
    assert registry_names(m) == ()


def test_an_instance_forward_that_was_there_before_comes_back() -> None:
    m = linear()
    custom = lambda x: x * 2
    m.forward = custom
    reg = HookRegistry.of(m)
    reg.register("a", ModelHook())
    reg.remove("a")
    assert m.__dict__["forward"] is custom


def test_signature_is_preserved_while_hooked() -> None:
    m = linear()
    sig = inspect.signature(m.forward)
    HookRegistry.of(m).register("a", ModelHook())
    assert inspect.signature(m.forward) == sig


def test_module_is_freed_after_removal_without_the_garbage_collector() -> None:
    gc.disable()
    try:
        m = linear()
        reg = HookRegistry.of(m)
        reg.register("a", Recorder("a", []))
        m(torch.ones(1, 4))
        reg.remove("a")
        del reg
        ref = weakref.ref(m)
        del m
        assert ref() is None
    finally:
        gc.enable()


def test_attach_and_detach_callbacks_run_once_each() -> None:
    events: list[str] = []

    class Tracked(ModelHook):
        def on_attach(self, module):
            events.append(f"attach:{type(module).__name__}")

        def on_detach(self, module):
            events.append(f"detach:{type(module).__name__}")

    reg = HookRegistry.of(linear())
    reg.register("t", Tracked())
    reg.remove("t")
    assert events == ["attach:Linear", "detach:Linear"]



def test_registering_a_non_hook_is_a_clear_error() -> None:
    with pytest.raises(HookError, match="expected a hookkit.core.registry.ModelHook, got function"):
        HookRegistry.of(linear()).register("f", lambda *a: a)  # type: ignore[arg-type]


def test_a_register_that_fails_leaves_a_fresh_module_untouched() -> None:
    """`HookRegistry.of` installs the wrapper; a refused hook must not leave it (nor the registry) behind."""
    m = linear()
    before = dict(m.__dict__)
    with pytest.raises(HookError, match="expected a hookkit.core.registry.ModelHook"):
        HookRegistry.of(m).register("f", lambda *a: a)  # type: ignore[arg-type]
    assert m.__dict__ == before


def test_a_hook_whose_on_attach_raises_is_not_left_in_the_chain() -> None:
    class Refuses(ModelHook):
        def on_attach(self, module):
            raise RuntimeError("cannot attach to this module")

    log: list[str] = []
    m = linear()
    reg = HookRegistry.of(m)
    reg.register("a", Recorder("a", log))
    with pytest.raises(RuntimeError, match="cannot attach to this module"):
        reg.register("bad", Refuses(), position=0)
    m(torch.ones(1, 4))
    assert reg.names == ("a",)
    assert log == ["pre:a", "post:a"]
    fresh = linear()
    before = dict(fresh.__dict__)
    with pytest.raises(RuntimeError, match="cannot attach to this module"):
        HookRegistry.of(fresh).register("bad", Refuses())
    assert fresh.__dict__ == before


def test_an_uninstalled_registry_refuses_new_hooks_instead_of_ignoring_them() -> None:
    m = linear()
    reg = HookRegistry.of(m)
    reg.register("a", ModelHook())
    reg.remove("a")
    with pytest.raises(HookError, match=r"register\('b'\): expected a registry still installed .*HookRegistry.of\(module\)"):
        reg.register("b", ModelHook())
    with pytest.raises(HookError, match=r"set_inner: expected a registry still installed"):
        reg.set_inner(lambda *a: a)
    assert "forward" not in m.__dict__ and registry_names(m) == ()


def test_deepcopy_of_a_hooked_module_is_refused_and_works_after_removal() -> None:
    """A copy would share the wrapper `forward` and silently run the original module's hooks and weights."""
    m = linear()
    reg = HookRegistry.of(m)
    reg.register("add", AddOne())
    with pytest.raises(HookError, match=r"copy.deepcopy\(Linear\): expected a module without hookkit hooks, got one carrying \['add'\]"):
        copy.deepcopy(m)
    reg.remove("add")
    clone = copy.deepcopy(m)
    with torch.no_grad():
        clone.weight.zero_()
        clone.bias.zero_()
    assert torch.equal(clone(torch.ones(1, 4)), torch.zeros(1, 4))
    assert "forward" not in clone.__dict__


def test_hooks_around_an_inner_callable_run_outside_it() -> None:
    """set_inner puts a callable (e.g. a compiled forward) at the centre; hooks wrap it from outside."""
    log: list[str] = []
    m = linear()
    reg = HookRegistry.of(m)
    reg.register("r", Recorder("r", log))
    original = reg.original_forward

    def inner(*args, **kwargs):
        log.append("inner")
        return original(*args, **kwargs)

    reg.set_inner(inner)
    m(torch.ones(1, 4))
    assert log == ["pre:r", "inner", "post:r"]
    reg.set_inner(None)
    reg.remove("r")
    assert "forward" not in m.__dict__


def _recording_backend(graphs: list[torch.fx.GraphModule]):
    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def test_a_hook_on_a_module_compiled_with_module_compile_is_traced_into_the_graph() -> None:
    """module.compile() compiles _call_impl -> forward (the hook wrapper): the hook's `+ 1` is in the graph."""
    graphs: list[torch.fx.GraphModule] = []
    m = linear()
    HookRegistry.of(m).register("add", AddOne())
    m.compile(backend=_recording_backend(graphs), fullgraph=True)
    out = m(torch.ones(1, 4))
    assert len(graphs) == 1
    assert any("add" in op for op in _ops(graphs[0]))
    assert torch.equal(out, torch.nn.Linear.forward(m, torch.ones(1, 4)) + 1)


def test_a_hook_around_a_compiled_inner_forward_runs_outside_the_graph() -> None:
    """set_inner(torch.compile(original_forward)) -- what hookkit.Compile does: the graph holds only the module."""
    graphs: list[torch.fx.GraphModule] = []
    m = linear()
    reg = HookRegistry.of(m)
    reg.register("add", AddOne())
    reg.set_inner(torch.compile(reg.original_forward, backend=_recording_backend(graphs), fullgraph=True))
    out = m(torch.ones(1, 4))
    assert len(graphs) == 1
    assert not any("add" in op for op in _ops(graphs[0]))
    assert torch.equal(out, torch.nn.Linear.forward(m, torch.ones(1, 4)) + 1)


def test_shallow_copy_of_a_hooked_module_is_refused_and_works_after_removal() -> None:
    """copy.copy shares `__dict__` values: the copy would run this module's hooks and never be enabled itself."""
    m = linear()
    reg = HookRegistry.of(m)
    reg.register("add", AddOne())
    with pytest.raises(HookError, match=r"^copy.copy\(Linear\): expected a module without hookkit hooks, got one carrying \['add'\]"):
        copy.copy(m)
    reg.remove("add")
    clone = copy.copy(m)
    assert "forward" not in clone.__dict__ and "__getstate__" not in clone.__dict__
