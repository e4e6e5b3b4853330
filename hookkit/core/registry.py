"""The hook core: `ModelHook` and one ordered, named `HookRegistry` per module.

The first hook on a module puts two entries into `module.__dict__`: `forward` (a wrapper that runs the
chain) and `_hookkit_registry`. Removing the last hook deletes both, so the module is exactly as it was:
nothing is left in `module.__dict__`, no reference cycle keeps it alive, nothing is ever set on a class.
`copy.copy`, `copy.deepcopy` and pickling of a hooked module raise (the copy would run this module's hooks
and share its per-call state): a third entry, `__getstate__`, refuses them, and goes with the other two.

Hooks run in registry order (`registry.names`): for hooks `[a, b]`, `a.pre_forward -> b.pre_forward ->
forward -> b.post_forward -> a.post_forward`; `position=` inserts anywhere, `remove(name)` takes a hook out
of the middle. `set_inner(fn)` replaces the callable at the centre of the chain: `hookkit.Compile` installs
`torch.compile(forward)` there, so hooks run *outside* the compiled region, in eager Python, and decisions
(caching) and copies (CUDA-graph safety) are never traced into a graph. (`module.compile()` would trace the
hooks into the graph instead: a `.clone()` there is compiled away.)
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from hookkit.core.removal import MISSING, restore_entry
from hookkit.errors import HookError

_REGISTRY_ATTR = "_hookkit_registry"

Args = tuple[Any, ...]
Kwargs = dict[str, Any]


class ModelHook:
    """Base class of every hook. Override what you need; the defaults are no-ops.

    - `pre_forward(module, args, kwargs) -> (args, kwargs)`: runs before the call, may replace inputs.
    - `post_forward(module, output) -> output`: runs after the call, may replace the output.
    - `new_forward(module, call_next, args, kwargs) -> output`: only when `replaces_forward = True`;
      decides whether and how to run the rest of the chain (`call_next(*args, **kwargs)`), so a hook
      can skip a block and return a cached result.
    - `on_attach(module)` / `on_detach(module)`: called once when registered / removed.
    """

    replaces_forward: bool = False

    def on_attach(self, module: torch.nn.Module) -> None:
        """Called once, after the hook is in the chain."""

    def on_detach(self, module: torch.nn.Module) -> None:
        """Called once, after the hook has left the chain."""

    def pre_forward(self, module: torch.nn.Module, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        return output

    def new_forward(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Args, kwargs: Kwargs) -> Any:
        return call_next(*args, **kwargs)


class HookRegistry:
    """The ordered, named hooks of one module. Get it with `HookRegistry.of(module)`."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._hooks: dict[str, ModelHook] = {}
        self._chain: tuple[ModelHook, ...] = ()
        self._saved_forward = module.__dict__.get("forward", MISSING)
        self._original_forward: Callable[..., Any] = module.forward
        self._inner: Callable[..., Any] = self._original_forward
        self._wrapper: Callable[..., Any] | None = None
        self._getstate: Callable[[], Any] | None = None
        self._install()

    # -- lookup ---------------------------------------------------------------------------------------
    @staticmethod
    def of(module: torch.nn.Module, create: bool = True) -> HookRegistry | None:
        """The registry of `module`; created (and the wrapper installed) on first use when `create`."""
        registry = module.__dict__.get(_REGISTRY_ATTR)
        if registry is None and create:
            registry = HookRegistry(module)
        return registry

    @property
    def outermost(self) -> bool:
        """Whether hookkit's wrapper is the module's `forward` now, so another library's hooks on the module (diffusers'
        context-parallel splits) run inside hookkit's and hookkit's hooks see the arguments before them."""
        return self._module is not None and self._module.__dict__.get("forward") is self._wrapper

    @property
    def names(self) -> tuple[str, ...]:
        """Hook names in execution order (outermost first)."""
        return tuple(self._hooks)

    def get(self, name: str) -> ModelHook | None:
        return self._hooks.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._hooks

    def __len__(self) -> int:
        return len(self._hooks)

    # -- registration ---------------------------------------------------------------------------------
    def register(self, name: str, hook: ModelHook, position: int | None = None) -> ModelHook:
        """Insert `hook` under `name` at `position` (default: innermost, i.e. last).

        All or nothing: if it raises (a bad argument, or `hook.on_attach` failing), the chain is as before,
        and a registry that `HookRegistry.of` has just created for it is uninstalled again.
        """
        self._check_live(f"register({name!r})")
        inserted = False
        try:
            if not isinstance(hook, ModelHook):
                raise HookError(
                    f"register({name!r}): expected a hookkit.core.registry.ModelHook, got {type(hook).__name__}. "
                    "Subclass ModelHook and override pre_forward/post_forward/new_forward."
                )
            if name in self._hooks:
                raise HookError(
                    f"{type(self._module).__name__}: a hook named {name!r} is already registered "
                    f"(hooks: {list(self._hooks)}). Remove it first (registry.remove({name!r})) or choose another name."
                )
            items = list(self._hooks.items())
            if position is None:
                position = len(items)
            if not (isinstance(position, int) and 0 <= position <= len(items)):
                raise HookError(f"register({name!r}): position must be an int in [0, {len(items)}], got {position!r}.")
            items.insert(position, (name, hook))
            self._set_hooks(dict(items))
            inserted = True
            hook.on_attach(self._module)
        except BaseException:
            if inserted:
                self._set_hooks({k: v for k, v in self._hooks.items() if k != name})
            self._uninstall_if_idle()
            raise
        return hook

    def remove(self, name: str) -> ModelHook:
        """Remove the hook `name` (from anywhere in the chain). The last removal restores the module."""
        self._check_live(f"remove({name!r})")
        if name not in self._hooks:
            raise HookError(
                f"{type(self._module).__name__}: no hook named {name!r} (hooks: {list(self._hooks)})."
            )
        module = self._module
        hook = self._hooks[name]
        self._set_hooks({k: v for k, v in self._hooks.items() if k != name})
        self._uninstall_if_idle()
        hook.on_detach(module)
        return hook

    def set_inner(self, fn: Callable[..., Any] | None) -> None:
        """Replace the callable at the centre of the chain (e.g. a compiled `forward`); `None` restores it.

        Hooks registered here then run *outside* `fn`. Used by regional compilation so that decisions and
        copies are not traced into the graph.
        """
        self._check_live("set_inner")
        self._inner = self._original_forward if fn is None else fn
        self._uninstall_if_idle()

    @property
    def original_forward(self) -> Callable[..., Any]:
        """The forward that was in place before hookkit (bound method of the class, usually)."""
        return self._original_forward

    def _set_hooks(self, hooks: dict[str, ModelHook]) -> None:
        self._hooks = hooks
        self._chain = tuple(hooks.values())

    def _check_live(self, what: str) -> None:
        """A registry whose last hook went has let go of its module: using it would silently do nothing."""
        if self._module is None:
            raise HookError(
                f"HookRegistry.{what}: expected a registry still installed on its module, got one that was uninstalled "
                "when its last hook was removed. Get the module's current one with HookRegistry.of(module)."
            )

    def _uninstall_if_idle(self) -> None:
        if self._module is not None and not self._hooks and self._inner is self._original_forward:
            self._uninstall()

    def __deepcopy__(self, memo: dict[int, Any]) -> HookRegistry:
        # `copy.deepcopy` copies the wrapper `forward` in `module.__dict__` by reference (functions are atomic),
        # so the copy would silently run *this* module's hooks and weights. Refuse instead.
        name = type(self._module).__name__ if self._module is not None else "module"
        raise HookError(
            f"copy.deepcopy({name}): expected a module without hookkit hooks, got one carrying {list(self._hooks)}. "
            "Remove hookkit first (handle.remove() or hookkit.disable(...)), copy, then enable it again."
        )

    # -- execution ------------------------------------------------------------------------------------
    def _run(self, index: int, args: Args, kwargs: Kwargs) -> Any:
        chain = self._chain
        if index == len(chain):
            return self._inner(*args, **kwargs)
        hook = chain[index]
        module = self._module
        args, kwargs = hook.pre_forward(module, args, kwargs)
        if hook.replaces_forward:
            output = hook.new_forward(module, functools.partial(self._call_from, index + 1), args, kwargs)
        else:
            output = self._run(index + 1, args, kwargs)
        return hook.post_forward(module, output)

    def _call_from(self, index: int, *args: Any, **kwargs: Any) -> Any:
        return self._run(index, args, kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle (torch.save(module)) would otherwise fail on the wrapper `forward` with an error naming the
        # model's class method, not hookkit
        name = type(self._module).__name__ if self._module is not None else "module"
        raise HookError(
            f"pickle of {name}: expected a module without hookkit hooks, got one carrying {list(self._hooks)}. "
            "Save its weights instead (module.state_dict(), save_pretrained), or remove hookkit first "
            "(handle.remove() or hookkit.disable(...))."
        )

    # -- install / uninstall -------------------------------------------------------------------------
    def _install(self) -> None:
        module = self._module
        original = self._original_forward

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._run(0, args, kwargs)

        def getstate() -> Any:
            self._refuse_copy(sys._getframe(1))

        module.__dict__[_REGISTRY_ATTR] = self  # first: pickle meets it (and its clear error) before `forward`
        module.__dict__["forward"] = forward
        module.__dict__["__getstate__"] = getstate
        self._wrapper = forward
        self._getstate = getstate

    def _refuse_copy(self, caller: Any) -> None:
        """`__getstate__` of a hooked module: copy.copy, copy.deepcopy and pickle all ask for it; each is refused."""
        code = caller.f_code if caller is not None else None
        if code is not None and code.co_filename == copy.__file__ and code.co_name == "deepcopy":
            self.__deepcopy__({})
        if code is not None and code.co_filename == copy.__file__:
            name = type(self._module).__name__ if self._module is not None else "module"
            raise HookError(
                f"copy.copy({name}): expected a module without hookkit hooks, got one carrying {list(self._hooks)} (the "
                "copy would share this module's hooks and their per-call state, and could never be enabled itself). "
                "Remove hookkit first (handle.remove() or hookkit.disable(...)), copy, then enable it again."
            )
        self.__reduce_ex__(4)

    def _uninstall(self) -> None:
        """Give the module its forward back, unless another library has wrapped or replaced hookkit's since.

        accelerate's offload hooks and diffusers' own hooks capture `module.forward` when they attach and put it
        back when they detach. If one attached after hookkit, its wrapper stays (removing it would silently turn
        it off) and hookkit's wrapper, which it holds, becomes a pass-through to the forward hookkit wrapped. If one
        detached after hookkit attached, it already restored what it captured: putting hookkit's saved forward
        back would revive its stale wrapper. Either way `module.__dict__["forward"]` is not hookkit's any more and
        is left as it is.
        """
        d = self._module.__dict__
        if restore_entry(d, "forward", self._wrapper, self._saved_forward):
            # Nobody else holds the wrapper: drop every reference to the module so nothing here keeps it alive
            # (a `module.forward` captured while enabled and called now gets a clear error).
            self._original_forward = self._inner = _dead_forward
        # else: another library holds the wrapper; with no hooks left it passes through to the original forward.
        if d.get("__getstate__") is self._getstate:
            del d["__getstate__"]
        d.pop(_REGISTRY_ATTR, None)
        self._wrapper = None
        self._module = None  # type: ignore[assignment]


def _dead_forward(*args: Any, **kwargs: Any) -> Any:
    raise HookError(
        "hookkit forward wrapper: expected to be called while its hooks are installed, got a call after they were "
        "all removed (a `module.forward` captured while hookkit was enabled). Call the module itself, module(...)."
    )


def registry_names(module: torch.nn.Module) -> tuple[str, ...]:
    """Hook names on `module` in execution order; `()` when it carries none."""
    registry = HookRegistry.of(module, create=False)
    return registry.names if registry is not None else ()
