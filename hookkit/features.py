"""The composition layer: every technique's feature, registered in one table, and `enable` over it.

The table is keyed by `Spec` field and ordered as features attach: quantization first (it swaps weights
before anything hooks the layers), context parallelism (diffusers' hooks around the transformer), memo and the sync-free loop next (transformer and scheduler hooks), the
cache, the attention kernel choice (block hooks inside the cache's, so a block the cache skips counts no kernel), and compile
last (it wraps the forwards the other hooks surround). Each entry is validated when the
table is built (`hookkit.core.feature.FeatureTable`): a malformed feature is refused at import.
"""

from __future__ import annotations

from typing import Any

from hookkit.adapters import AdapterSpec
from hookkit.core.feature import FeatureTable
from hookkit.core.handle import Handle, enable_with, plan_for
from hookkit.core.plan import Plan
from hookkit.spec import Spec
from hookkit.techniques import memo, sync_free
from hookkit.techniques.attention import hooks as attention
from hookkit.techniques.parallel import hooks as parallel
from hookkit.techniques.cache import hooks as cache
from hookkit.techniques.compile import hooks as compile_
from hookkit.techniques.quantize import torchao as quantize

#: every feature hookkit ships, in attach order
FEATURES = FeatureTable(Spec, [quantize.FEATURE, parallel.FEATURE, memo.FEATURE, sync_free.FEATURE, cache.FEATURE,
                               attention.FEATURE, compile_.FEATURE])


def enable(target: Any, spec: Spec | None = None, *, adapter: AdapterSpec | None = None) -> Handle:
    """Attach hookkit to a diffusers pipeline or a bare transformer. All or nothing; twice raises.

    Args:
        target: a diffusers pipeline with a `transformer`, or the transformer module itself.
        spec: what to turn on; `None` (or `Spec()`) attaches only the per-call bookkeeping.
        adapter: the model's adapter; resolved from the transformer's exact class when not given.
    """
    return enable_with(target, spec if spec is not None else Spec(), adapter, FEATURES)


def build_plan(target: Any, spec: Spec | None = None, adapter: AdapterSpec | None = None) -> Plan:
    """The plan `enable(target, spec)` would attach, as data. Attaches nothing."""
    return plan_for(target, spec if spec is not None else Spec(), adapter, FEATURES)
