"""Every rule about which features combine, in one table.

A rule names two features (`Spec` fields), when it applies (a predicate on the spec and the adapter) and
its outcome: `refused` raises the rule's error before anything is planned or attached; `inactive` turns
the first feature off for this spec (it plans nothing and its summary gives the reason). A pair with no
rule combines freely. Rules that concern one feature alone stay with that feature.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from hookkit.errors import HookkitError, SpecError

if TYPE_CHECKING:
    from hookkit.adapters import AdapterSpec
    from hookkit.core.plan import AnySpec

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@attrs.frozen(kw_only=True)
class Rule:
    """One rule of the table."""

    #: the features it is about: (the one it refuses or turns off, the other)
    features: tuple[str, str]
    outcome: str = attrs.field(validator=attrs.validators.in_(("refused", "inactive")))
    applies: Callable[[AnySpec, AdapterSpec], bool]
    #: the error or reason, read from the spec and adapter it applies to
    message: Callable[[AnySpec, AdapterSpec], str]
    error: type[HookkitError] = SpecError


def _whole_graphs(spec: AnySpec) -> bool:
    return spec.compile is not None and spec.compile.cuda_graphs == "transformer"


def _taylorseer_cache(spec: AnySpec) -> bool:
    return spec.cache is not None and bool(spec.cache.taylorseer_order)


def _dynamic_cache(spec: AnySpec) -> bool:
    """DBCache decides at the call (the threshold rule without a static mask): split graphs."""
    cache = spec.cache
    return (cache is not None and cache.rule == "threshold" and cache.threshold > 0
            and not (cache.steps_mask is not None and cache.mask_policy == "static"))


RULES: tuple[Rule, ...] = (
    Rule(
        features=("compile", "cache"), outcome="refused",
        applies=lambda s, a: s.cache is not None and s.compile is not None and not s.compile.regional,
        message=lambda s, a: (
            "Compile.regional: expected True with DBCache (its per-step decision must stay outside the compiled "
            "graph), got False. Use Compile(regional=True)."),
    ),
    Rule(
        features=("compile", "cache"), outcome="refused",
        # decisions known before the call (a static mask, the magnitude and schedule rules) run as one graph per
        # decision and TaylorSeer's extrapolation is written into the residual slots before a cached replay; a
        # threshold runs as graphs split at the decision, where nothing can run between the two graphs
        applies=lambda s, a: _whole_graphs(s) and _taylorseer_cache(s) and _dynamic_cache(s),
        message=lambda s, a: (
            "DBCache.taylorseer_order: expected 0 with Compile(cuda_graphs='transformer') and a threshold decided at "
            "each call (split graphs: the extrapolation would have to run between the two graphs of a call), got "
            f"{s.cache.taylorseer_order}. Use DBCache(taylorseer_order=0), decisions known before the call (a static "
            "mask, rule='magnitude' or 'schedule'), or Compile(mode='reduce-overhead') (CUDA graphs per block)."),
    ),
    Rule(
        # e.g. Qwen-Image's prologue runs torch.as_tensor(python_int, device=cuda): a pageable host copy that
        # stream capture refuses, and a constant a replayed graph would never rebuild
        features=("compile", "memo"), outcome="refused",
        applies=lambda s, a: _whole_graphs(s) and a.memo_scope != "none" and not s.memo,
        message=lambda s, a: (
            f"Spec.memo: expected True with Compile(cuda_graphs='transformer') on {a.name!r} (its prologue builds "
            f"tensors from Python data every call: adapter memo_scope={a.memo_scope!r}), got False. Use "
            "Spec(memo=True, compile=Compile(cuda_graphs='transformer'))."),
    ),
    Rule(
        # a host sync in the transformer's own forward (the adapter's `host_syncs`) makes every capture fail; refused
        # at enable, before the first call runs eagerly for nothing
        features=("compile",), outcome="refused",
        applies=lambda s, a: _whole_graphs(s) and bool(a.host_syncs),
        message=lambda s, a: (
            f"Compile.cuda_graphs: expected 'none' on {a.name!r}, whose forward waits for the host outside its blocks "
            f"({'; '.join(a.host_syncs)}): no CUDA graph can capture that; got 'transformer'. Use "
            "Compile(cuda_graphs='none'): its blocks are still compiled regionally."),
    ),
    Rule(
        # diffusers' Ulysses attention exchanges heads for sequence (all-to-all), then runs its backend's forward op on
        # the whole sequence: the "native" op calls torch's SDPA there, where hookkit's kernel choice answers it.
        # Ring attention merges per-shard partial results by their log-sum-exp, which no kernel hookkit chooses at
        # an SDPA call returns (and diffusers' "native" op refuses it); another backend never reaches torch's SDPA
        features=("attention", "parallel"), outcome="refused",
        applies=lambda s, a: (s.attention is not None and s.parallel is not None
                              and (s.parallel.ring > 1 or s.parallel.attention_backend not in (None, "native"))),
        message=lambda s, a: (
            "Spec.attention: expected ContextParallel with ring=1 and attention_backend None or 'native' (Ulysses "
            "alone: hookkit's kernel then answers the SDPA call diffusers' all-to-all makes on the whole sequence), got "
            f"ContextParallel(ulysses={s.parallel.ulysses}, ring={s.parallel.ring}, "
            f"attention_backend={s.parallel.attention_backend!r}). Use ContextParallel(ulysses=N), or drop "
            "Attention and choose diffusers' backend with ContextParallel(attention_backend=...)."),
    ),
    Rule(
        # the kernel choice is a torch-function mode around each block, which dynamo traces into each compiled block
        # (one entry per kernel, chosen again at every call); a whole-model compile would trace the block hooks
        features=("attention", "compile"), outcome="refused",
        applies=lambda s, a: s.attention is not None and s.compile is not None and not s.compile.regional,
        message=lambda s, a: (
            "Spec.compile: expected Compile(regional=True) with Attention (its kernel choice changes between steps "
            "around each block, and a whole-model compile would trace the hooks), got Compile(regional=False). Use "
            "Compile() (regional; cuda_graphs='transformer' keys its graphs by the step's kernel), or drop Attention."),
    ),
    Rule(
        # whole-transformer graphs key each graph by every feature's decision known before the call (the attention
        # kernel of the step's phase among them); graphs split at a threshold's decision have no key for it
        features=("attention", "compile"), outcome="refused",
        applies=lambda s, a: s.attention is not None and _whole_graphs(s) and _dynamic_cache(s),
        message=lambda s, a: (
            "Spec.attention: expected None with Compile(cuda_graphs='transformer') and a DBCache threshold decided at "
            "each call (graphs split at that decision are keyed by it alone, so they would replay one step's "
            "attention kernels at every step), got an Attention. Use a static mask (DBCache(steps_mask=..., "
            "mask_policy='static')) or rule='magnitude'/'schedule', or cuda_graphs='none' (regional compile)."),
    ),
    Rule(
        features=("memo", "compile"), outcome="inactive",
        applies=lambda s, a: s.memo and s.compile is not None and not s.compile.regional,
        message=lambda s, a: "Compile(regional=False) compiles the prologue itself (its constants are baked into the graph)",
    ),
)


def check(spec: AnySpec, adapter: AdapterSpec, rules: tuple[Rule, ...] = RULES) -> None:
    """Raise the error of the first refusing rule that applies to `spec` on `adapter`."""
    for rule in rules:
        if rule.outcome == "refused" and rule.applies(spec, adapter):
            raise rule.error(rule.message(spec, adapter))


def inactive_reason(feature: str, spec: AnySpec, adapter: AdapterSpec, rules: tuple[Rule, ...] = RULES) -> str | None:
    """Why another feature in `spec` turns `feature` off, or None."""
    for rule in rules:
        if rule.outcome == "inactive" and rule.features[0] == feature and rule.applies(spec, adapter):
            return rule.message(spec, adapter)
    return None


def outcome(spec: AnySpec, adapter: AdapterSpec, rules: tuple[Rule, ...] = RULES) -> list[tuple[Rule, Any]]:
    """Every rule that applies to `spec` on `adapter`, with its message: what the table says about it."""
    return [(r, r.message(spec, adapter)) for r in rules if r.applies(spec, adapter)]
