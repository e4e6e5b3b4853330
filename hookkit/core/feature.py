"""The feature contract: the only door between the core and a technique.

A technique is one `Feature` object named after its `Spec` field. `enable` asks every feature in the
table whose field is set to `plan` (pure data: `Attachment`s), then calls `attach` once per attachment
with an `AttachContext`: the transformer, the pipeline, the per-call state, a slot for the feature's own
long-lived object, scheduler listeners and the services other features provide. It never sees the
`Handle`. `summarize` and `check_removable` get the same context later.

`FeatureTable` is where features are registered, in attach order. It validates each one at once and
refuses a malformed feature with an error that says which feature, what is wrong and why (as pluggy does).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, runtime_checkable

import attrs

from hookkit.core.graphs import combine
from hookkit.core.listeners import SchedulerListener
from hookkit.core.removal import Removable, Removal
from hookkit.errors import HookError

if TYPE_CHECKING:
    import torch

    from hookkit.adapters import AdapterSpec
    from hookkit.core.plan import AnySpec, Attachment, Plan, PlanContext
    from hookkit.core.state import CallState
    from hookkit.core.summary import FeatureSummary

T = TypeVar("T")


@runtime_checkable
class Feature(Protocol):
    """What a technique implements to plug into `hookkit.enable`.

    Attributes:
        name: the `Spec` field it implements; also its hook-name prefix (`hookkit.<name>.*`), its key in
            `CallState.features` and in `handle.summary().features`.
        spec_class: the type of that field's value (`DBCache`, `Quantize`, `bool`, ...).
    """

    name: str
    spec_class: type

    def plan(self, ctx: PlanContext) -> list[Attachment]:
        """The attachments for `ctx.spec` as data; reads only. May raise to refuse the spec."""
        ...

    def attach(self, ctx: AttachContext, attachment: Attachment) -> Removable:
        """Perform one planned attachment; return what undoes it."""
        ...

    def summarize(self, ctx: AttachContext) -> FeatureSummary | None:
        """Statistics for `handle.summary()`, or None."""
        ...

    def check_removable(self, ctx: AttachContext) -> None:
        """Raise before anything is removed if removal cannot restore the model (called by `remove()`)."""
        ...


class BaseFeature:
    """Defaults for the optional members: no summary, always removable."""

    name: ClassVar[str]
    spec_class: ClassVar[type]

    def summarize(self, ctx: AttachContext) -> FeatureSummary | None:
        return None

    def check_removable(self, ctx: AttachContext) -> None:
        return None


#: every member of the contract and the number of arguments it takes after `self`
MEMBERS: dict[str, int] = {"plan": 1, "attach": 2, "summarize": 1, "check_removable": 1}


def check_feature(feature: Any, spec_type: type) -> None:
    """Refuse a malformed feature: who (its class), what (the member), why (what the contract needs)."""
    who = f"hookkit feature {type(feature).__module__}.{type(feature).__qualname__}"
    name = getattr(feature, "name", None)
    fields = attrs.fields_dict(spec_type)
    if not isinstance(name, str) or name not in fields:
        raise HookError(f"{who}: name expected one of the {spec_type.__name__} fields {sorted(fields)}, got {name!r} "
                        "(a feature implements exactly one Spec field and is named after it). Set `name`.")
    spec_class = getattr(feature, "spec_class", None)
    allowed = _field_types(spec_type, name)
    if spec_class not in allowed:
        raise HookError(f"{who} ({name!r}): spec_class expected the type of {spec_type.__name__}.{name} "
                        f"({' or '.join(t.__name__ for t in allowed)}), got {spec_class!r}. Set `spec_class`.")
    for member, arity in MEMBERS.items():
        method = getattr(feature, member, None)
        if not callable(method):
            raise HookError(f"{who} ({name!r}): {member} expected a method, got {method!r} (every member of "
                            "hookkit.core.feature.Feature is required). Subclass BaseFeature for the defaults.")
        try:
            parameters = inspect.signature(method).parameters.values()
        except (TypeError, ValueError):
            continue
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        varargs = any(p.kind is p.VAR_POSITIONAL for p in parameters)
        if not varargs and len(positional) != arity:
            raise HookError(f"{who} ({name!r}): {member} expected {arity} argument(s) after self, got "
                            f"{len(positional)} ({', '.join(p.name for p in positional) or 'none'}). See "
                            "hookkit.core.feature.Feature for the signatures.")


def _field_types(spec_type: type, name: str) -> tuple[type, ...]:
    """The classes a Spec field may hold, None aside (`DBCache | None` -> (DBCache,))."""
    hint = typing.get_type_hints(spec_type)[name]
    args = typing.get_args(hint) or (hint,)
    return tuple(a for a in args if a is not type(None))


class FeatureTable(Mapping[str, Feature]):
    """The registered features, keyed by `Spec` field, in attach order. Validated on construction."""

    def __init__(self, spec_type: type, features: list[Any]) -> None:
        table: dict[str, Feature] = {}
        for feature in features:
            check_feature(feature, spec_type)
            if feature.name in table:
                raise HookError(
                    f"hookkit feature {type(feature).__qualname__}: name {feature.name!r} expected once in the "
                    f"table, got it a second time (already {type(table[feature.name]).__qualname__}). One feature "
                    "per Spec field: remove one of them."
                )
            table[feature.name] = feature
        self.spec_type = spec_type
        self._table = table

    def __getitem__(self, name: str) -> Feature:
        return self._table[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return f"FeatureTable({list(self._table)})"


def requested(spec: Any, name: str) -> bool:
    """Whether `spec` turns feature `name` on: its field is set (not None, not False)."""
    value = getattr(spec, name)
    return value is not None and value is not False


class _ListenerRemoval(Removal):
    def __init__(self, listeners: list[Any], listener: Any) -> None:
        self._listeners = listeners
        self._listener = listener

    def _undo(self) -> None:
        if self._listener in self._listeners:
            self._listeners.remove(self._listener)


class HandleView(Protocol):
    """What an `AttachContext` reads of its `hookkit.core.handle.Handle`. A protocol rather than the class: the
    handle imports this contract, so the contract names only what it uses and never imports the handle."""

    @property
    def transformer(self) -> torch.nn.Module: ...
    @property
    def pipeline(self) -> Any | None: ...
    @property
    def spec(self) -> AnySpec: ...
    @property
    def adapter(self) -> AdapterSpec: ...
    @property
    def plan(self) -> Plan: ...
    @property
    def state(self) -> CallState: ...
    @property
    def in_generation(self) -> bool: ...
    #: the handle owning the scheduler patches (itself, or the pipeline's first transformer's)
    primary: HandleView
    scheduler_listeners: list[SchedulerListener]
    first_call_listeners: list[Callable[[Any], None]]
    _slots: dict[str, Any]
    #: protocol -> [factories in the order provided, the instance once requested]
    _services: dict[type, list[Any]]


class AttachContext:
    """What one feature may use while attached: a narrow, typed view of its handle.

    Read-only views of the target and the plan, the current `CallState`, one slot for the feature's own
    long-lived object (a compiled runner, a report, the hooks' shared state), scheduler listeners, and
    services that features provide to one another through a core protocol (see `hookkit.core.graphs`).
    """

    def __init__(self, handle: HandleView, feature: str) -> None:
        self._handle = handle
        self.feature = feature

    # -- what is hooked ---------------------------------------------------------------------------------
    @property
    def transformer(self) -> torch.nn.Module:
        return self._handle.transformer

    @property
    def pipeline(self) -> Any | None:
        return self._handle.pipeline

    @property
    def spec(self) -> AnySpec:
        return self._handle.spec

    @property
    def adapter(self) -> AdapterSpec:
        return self._handle.adapter

    @property
    def plan(self) -> Plan:
        return self._handle.plan

    def attachments(self) -> list[Attachment]:
        """This feature's planned attachments, in order."""
        return [a for a in self._handle.plan.attachments if a.feature == self.feature]

    # -- per call -------------------------------------------------------------------------------------
    @property
    def state(self) -> CallState:
        """The current (or last finished) generation's state; per-call data goes in `state.feature(...)`."""
        return self._handle.state

    @property
    def in_generation(self) -> bool:
        """Whether a `with handle.generation():` block is open (what a bare transformer's calls need)."""
        return self._handle.in_generation

    # -- the feature's slot -----------------------------------------------------------------------------
    def keep(self, value: T) -> T:
        """Keep `value` for the handle's lifetime (dropped at removal); returns it."""
        self._handle._slots[self.feature] = value
        return value

    def kept(self) -> Any | None:
        """What `keep` stored, or None."""
        return self._handle._slots.get(self.feature)

    @property
    def owns_pipeline(self) -> bool:
        """Whether this handle owns the pipeline-level patches: a single transformer's handle, or the pipeline's first
        transformer's (a pipeline method can be patched once: a companion's feature joins the owner's patch)."""
        return self._handle.primary is self._handle

    def owner_kept(self) -> Any | None:
        """What this feature keeps on the handle owning the scheduler patches: the pipeline's first transformer's
        (Wan 2.2's `transformer` for `transformer_2`; this handle's own for a single transformer), or None."""
        return self._handle.primary._slots.get(self.feature)

    # -- listeners and services -------------------------------------------------------------------------
    def add_listener(self, listener: SchedulerListener) -> Removal:
        """Run `listener` around the pipeline scheduler's `set_timesteps`/`step`; returns what takes it out."""
        listeners = self._handle.scheduler_listeners
        listeners.append(listener)
        return _ListenerRemoval(listeners, listener)

    def add_first_call_listener(self, listener: Callable[[Any], None]) -> Removal:
        """Hear what the first transformer call showed (`hookkit.core.firstcall.FirstCallReport`: block paths, the
        points where the forward changes the hidden stream between blocks); raise from `listener` to refuse it.
        Returns what takes it out."""
        listeners = self._handle.first_call_listeners
        listeners.append(listener)
        return _ListenerRemoval(listeners, listener)

    def provide(self, protocol: type[T], factory: Callable[[], T]) -> None:
        """Offer a service to later features; `factory` runs once, at the first `request`. Several features may
        provide one protocol when the core combines it (`hookkit.core.graphs.combine`: `GraphDecisions`)."""
        entry = self._handle._services.setdefault(protocol, [[], None])
        if entry[1] is not None:
            raise HookError(f"{self.feature}: provides {protocol.__name__} after a feature requested it; providers "
                            "attach before the features that request them (hookkit's feature order).")
        entry[0].append(factory)

    def request(self, protocol: type[T]) -> T | None:
        """The service earlier features provide for `protocol` (the core's combination when several do), or None
        when none does."""
        entry = self._handle._services.get(protocol)
        if entry is None:
            return None
        if entry[1] is None:
            entry[1] = combine(protocol, [factory() for factory in entry[0]])
        return entry[1]
