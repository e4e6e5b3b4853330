"""The adapter, confirmed at the first transformer call: what each block really receives and returns, in what order.

`enable` checks what it can statically (classes, argument names); this check confirms the rest on the real first
call, with observer hooks that the clock hook puts on every block for that call only (also taken off when it raises):

- the blocks run in the order of the `[[blocks]]` tables, each at most once per pass (an adapter whose block lists
  are out of order is refused); a call that runs the blocks again from the first is a new pass;
- each block gets a tensor at `hidden_arg` (and at `encoder_arg` where it returns that stream) and returns what
  `returns` says: one tensor, or a tuple with each stream's shape at its position (a trailing encoder may be None);
- the chain: each block's hidden input is the previous block's hidden output. A shape change in between is an
  `AdapterError` (the lists before it are a stage of their own: `[left_out]`); other values of the same shape (VACE
  hints, WanAnimate's face adapter, ControlNet residuals) are reported to the first-call listeners
  (`AttachContext.add_first_call_listener`), so that DBCache can refuse a split whose middle blocks they cut
  (unless the adapter names them in `between_block_args`).

A disagreement raises at the block where it shows, naming the block, what was found and the TOML to write, and the
check stays armed. Only the previous block's hidden output is held, never a call's activations. With a
whole-transformer compile (`Compile(regional=False)`) the observers would be traced into the graph: no check then.
Under whole-transformer CUDA graphs the checked call runs eagerly (`hookkit.core.graphs.EagerCalls`, true while
the observers are on): graphs are captured from the next call on, without them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import attrs
import torch

from hookkit.adapters import AdapterSpec, BlockListSpec
from hookkit.core.parallel import as_forward_sees
from hookkit.core.plan import flat_blocks
from hookkit.core.registry import Args, HookRegistry, Kwargs, ModelHook
from hookkit.errors import AdapterError


BLOCK_HOOK = "hookkit.check"


@attrs.frozen(kw_only=True)
class FirstCallReport:
    """What the first call showed: `gaps` are flat block indices i after which the forward changed the hidden
    stream before block i + 1 got it (same shape, other values)."""

    paths: tuple[str, ...]
    gaps: tuple[int, ...]
    called: tuple[int, ...]


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}(" + ", ".join(_describe(v) for v in value) + ")"
    return type(value).__name__


class _Locator:
    """Reads one named argument of a block call, positional or keyword."""

    def __init__(self, block: torch.nn.Module, name: str | None) -> None:
        params = list(inspect.signature(type(block).forward).parameters.values())[1:]
        names = [p.name for p in params]
        self.name = name
        self.pos = names.index(name) if name in names else -1
        self.default = params[self.pos].default if self.pos >= 0 else None
        if self.default is inspect.Parameter.empty:
            self.default = None

    def read(self, args: Args, kwargs: Kwargs) -> Any:
        if self.name is None:
            return None
        if self.name in kwargs:
            return kwargs[self.name]
        return args[self.pos] if 0 <= self.pos < len(args) else self.default


def _same_stream(out: tuple[int, ...], given: tuple[int, ...]) -> bool:
    """Whether a returned tensor of shape `out` is the stream given as `given`: the same shape, or a batch of 1
    broadcast to the batch (a prompt embedding of batch 1 with several images per prompt)."""
    return out == given or (len(out) == len(given) > 0 and out[1:] == given[1:] and given[0] == 1)


@attrs.define
class _Record:
    index: int
    hidden: Any
    encoder: Any


class _BlockObserver(ModelHook):
    def __init__(self, check: FirstCallCheck, index: int, spec: BlockListSpec, block: torch.nn.Module) -> None:
        self.check = check
        self.index = index
        self.spec = spec
        self.hidden = _Locator(block, spec.hidden_arg)
        self.encoder = _Locator(block, spec.encoder_arg)
        self.record: _Record | None = None

    def pre_forward(self, module: torch.nn.Module, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
        if self.check.recording:
            hidden, encoder = self.hidden.read(args, kwargs), self.encoder.read(args, kwargs)
            registry = HookRegistry.of(module, create=False)
            if registry is not None and registry.outermost:  # diffusers' hooks on the block run inside this one:
                hidden = as_forward_sees(module, self.spec.hidden_arg, hidden)  # compare what the block gets
                if self.spec.encoder_arg is not None:
                    encoder = as_forward_sees(module, self.spec.encoder_arg, encoder)
            self.record = _Record(self.index, hidden, encoder)
            self.check.enter(self.record)
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        record, self.record = self.record, None
        if self.check.recording and record is not None:
            self.check.leave(record, output)
        return output


class FirstCallCheck:
    """One per handle: the observers' findings during a checked call, and what happens once it passed.

    Checked as the blocks run, keeping only the previous block's hidden output (no call's worth of activations is
    held): a disagreement raises at the block where it shows.
    """

    def __init__(self, adapter: AdapterSpec, transformer: torch.nn.Module,
                 on_report: Callable[[FirstCallReport], None]) -> None:
        self.adapter = adapter
        self.transformer_class = type(transformer).__name__
        self.blocks = flat_blocks(adapter, transformer)
        self.on_report = on_report
        self.armed = True
        self.recording = False
        self.report: FirstCallReport | None = None
        self._reset()

    def _reset(self) -> None:
        #: block indices of each pass of the current call, and the previous block's (index, hidden output)
        self.passes: list[list[int]] = []
        self.previous: tuple[int, torch.Tensor] | None = None
        self.gaps: set[int] = set()

    def eager(self) -> bool:
        """`hookkit.core.graphs.EagerCalls`: True while a checked call runs (its observers must not be captured)."""
        return self.recording

    def run(self, call_next: Callable[..., Any], args: Args, kwargs: Kwargs) -> Any:
        """One transformer call with observers on every block; raises `AdapterError` at a disagreement."""
        attached: list[torch.nn.Module] = []
        self._reset()
        self.recording = True
        try:
            for index, (_, spec, block) in enumerate(self.blocks):
                HookRegistry.of(block).register(BLOCK_HOOK, _BlockObserver(self, index, spec, block), position=0)
                attached.append(block)
            output = call_next(*args, **kwargs)
        finally:
            self.recording = False
            self.previous = None
            for block in attached:
                registry = HookRegistry.of(block, create=False)
                if registry is not None and BLOCK_HOOK in registry:
                    registry.remove(BLOCK_HOOK)
        if self.passes:  # a call that ran no block has nothing to confirm yet: stay armed
            report = FirstCallReport(paths=tuple(p for p, _, _ in self.blocks), gaps=tuple(sorted(self.gaps)),
                                     called=tuple(self.passes[0]))
            self.on_report(report)  # a feature refusing what it saw raises here, and the check stays armed
            self.report = report
            self.armed = False
        return output

    # -- the checks, as the blocks run -------------------------------------------------------------------------
    def enter(self, record: _Record) -> None:
        index = record.index
        if not self.passes or (index == self.passes[0][0] and index <= self.passes[-1][-1]):
            # a new pass starts where the first one started (graph warm-up/capture run the blocks again)
            self.passes.append([])
            self.previous = None
        self.passes[-1].append(index)
        self._order(self.passes[-1])
        path, spec, cls = self._where(index)
        if not isinstance(record.hidden, torch.Tensor):
            raise AdapterError(
                f"{self._at(index)}: expected a tensor at hidden_arg {spec.hidden_arg!r} at the first call, got "
                f"{_describe(record.hidden)}. Set hidden_arg of [[blocks]] attr = \"{spec.attr}\" to the argument "
                f"that carries the hidden stream."
            )
        if self.previous is not None and self.previous[0] == index - 1:
            self._chain(index - 1, self.previous[1], index, record.hidden)

    def leave(self, record: _Record, output: Any) -> None:
        self._streams(record, output)
        spec = self._where(record.index)[1]
        hidden_out = output if len(spec.returns) == 1 else output[spec.hidden_index]
        self.previous = (record.index, hidden_out)

    def _where(self, index: int) -> tuple[str, BlockListSpec, str]:
        path, spec, block = self.blocks[index]
        return path, spec, type(block).__name__

    def _at(self, index: int) -> str:
        path, _, cls = self._where(index)
        return f"adapter {self.adapter.name!r} ({self.adapter.source}), {self.transformer_class}.{path} ({cls})"

    def _order(self, seen: list[int]) -> None:
        if len(seen) < 2 or seen[-2] < seen[-1]:
            return
        ran: list[str] = []
        for index in seen:
            attr = self.blocks[index][1].attr
            if not ran or ran[-1] != attr:
                ran.append(attr)
        tables = [b.attr for b in self.adapter.blocks]
        if len(set(ran)) == len(ran):
            rest = [t for t in tables if t not in ran]
            fix = f"Write the [[blocks]] tables in the order they run: {ran + rest} (the adapter has {tables})."
        else:
            fix = ("A list that runs more than once per call, or interleaved with another, is no chain DBCache "
                   "can cache: leave it out of [[blocks]] (name it in [left_out] with the reason).")
        raise AdapterError(
            f"adapter {self.adapter.name!r} ({self.adapter.source}) for {self.transformer_class}: expected the blocks "
            f"to run in the order of its [[blocks]] tables {tables}, each block once, got the lists in the order "
            f"{ran} at the first call ({self.blocks[seen[-1]][0]} ran after {self.blocks[seen[-2]][0]}). {fix}"
        )

    def _streams(self, record: _Record, out: Any) -> None:
        _, spec, _ = self._where(record.index)
        where = self._at(record.index)
        wants_encoder = spec.encoder_index is not None
        if wants_encoder and not isinstance(record.encoder, torch.Tensor):
            raise AdapterError(
                f"{where}: expected a tensor at encoder_arg {spec.encoder_arg!r} (the block returns that stream), got "
                f"{_describe(record.encoder)} at the first call. Set encoder_arg to the argument of the second stream "
                "the block returns, or returns = [\"hidden_states\"] if it returns one."
            )
        shapes = {"hidden_states": tuple(record.hidden.shape)}
        if wants_encoder:
            shapes["encoder_hidden_states"] = tuple(record.encoder.shape)
        expected = ", ".join(f"{s} {shapes[s]}" for s in spec.returns)
        if len(spec.returns) == 1:
            ok = isinstance(out, torch.Tensor) and _same_stream(tuple(out.shape), shapes["hidden_states"])
        else:
            # the encoder stream may end as None (SD3's last block, context_pre_only, drops it)
            ok = (isinstance(out, (tuple, list)) and len(out) == len(spec.returns)
                  and all((isinstance(o, torch.Tensor) and _same_stream(tuple(o.shape), shapes[s]))
                          or (o is None and s == "encoder_hidden_states") for o, s in zip(out, spec.returns)))
        if ok:
            return
        raise AdapterError(
            f"{where}: expected the block to return {spec.returns} ({expected}) at the first call, got "
            f"{_describe(out)}. {self._returns_fix(spec, record, out)}"
        )

    def _returns_fix(self, spec: BlockListSpec, record: _Record, out: Any) -> str:
        table = f"[[blocks]] attr = \"{spec.attr}\""
        if isinstance(out, torch.Tensor):
            return f"Write returns = [\"hidden_states\"] in {table} (it returns one tensor)."
        if isinstance(out, (tuple, list)) and isinstance(record.encoder, torch.Tensor):
            by_shape = []
            for o in out:
                if isinstance(o, torch.Tensor) and o.shape == record.hidden.shape:
                    by_shape.append("hidden_states")
                elif isinstance(o, torch.Tensor) and o.shape == record.encoder.shape:
                    by_shape.append("encoder_hidden_states")
            if len(by_shape) == len(out) and len(set(by_shape)) == len(out):
                return f"Write returns = {by_shape} in {table}."
        return (f"Describe what it returns in {table} (returns, encoder_arg), or leave the list out of [[blocks]] "
                "if its blocks are no chain of the hidden stream.")

    def _chain(self, before: int, hidden_out: torch.Tensor, after: int, hidden_in: torch.Tensor) -> None:
        if hidden_in is hidden_out:
            return
        if tuple(hidden_in.shape) == tuple(hidden_out.shape):
            if not torch.equal(hidden_in, hidden_out):  # same values in another tensor (BriaFibo splits and re-joins)
                self.gaps.add(before)
            return
        path_a, spec_a, _ = self._where(before)
        path_b, spec_b, _ = self._where(after)
        tables = [b.attr for b in self.adapter.blocks]
        earlier = tables[: tables.index(spec_b.attr)]
        raise AdapterError(
            f"adapter {self.adapter.name!r} ({self.adapter.source}) for {self.transformer_class}: expected the "
            f"hidden stream to keep its shape from {path_a} to {path_b} (one chain of blocks), got "
            f"{tuple(hidden_out.shape)} out of {path_a} and {tuple(hidden_in.shape)} into {path_b} at the "
            f"first call (the forward rebuilds it in between). "
            + (f"Move {earlier} from [[blocks]] to [left_out] (a stage before the cached chain)."
               if spec_a.attr != spec_b.attr and earlier else
               f"Leave {spec_b.attr} out of [[blocks]] (name it in [left_out] with the reason).")
        )


def install(adapter: AdapterSpec, transformer: torch.nn.Module,
            listeners: list[Callable[[FirstCallReport], None]]) -> FirstCallCheck:
    """The check of one handle: `listeners` (the handle's, which features add through
    `AttachContext.add_first_call_listener`, also after this call) hear its report."""

    def on_report(report: FirstCallReport) -> None:
        for listener in tuple(listeners):
            listener(report)

    return FirstCallCheck(adapter, transformer, on_report)
