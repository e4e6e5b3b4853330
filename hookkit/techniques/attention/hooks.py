"""The attention kernel per block and per denoising step (`Spec.attention`, `hookkit.Attention`).

Mechanism: one hook on each of the adapter's blocks runs the block under a torch-function mode that answers
`F.scaled_dot_product_attention` with the kernel chosen for that block at the current step (from the core's
`CallState`). Why a mode, not diffusers' `attention_backend(...)`: hookkit's kernel and sageattention 1.0.6 are no
diffusers backend (registering one would patch diffusers' enum and registry), and a mode changes nothing outside the
block call: no processor, module, class or process-wide setting, so removal restores nothing but the hooks. Why one
wrapping hook (`new_forward`), not a pre/post pair: the mode leaves the stack in a `finally`, also when the block
raises. Processors reach SDPA through diffusers' "native" backend: enable refuses processors set to another backend.

A block call counts once per kernel and step phase ("first", "middle", "last"). An attention call a kernel cannot take
(a mask, except a boolean one for hookkit's kernels, which take an outer-AND padding mask as its row: `outer_masks`;
dropout, grouped-query heads, too few keys for the Hopper fp8 kernels: known only at the call) runs as "native" and is
counted as a fallback with its reason. What a kernel can never run with (package, dtype, head size, no CUDA device or
one too old; the Hopper kernels where they do not build or compute something else: `enable` runs them) is refused at
enable. Under regional `Compile` dynamo traces the mode into each compiled block (an entry per kernel: `KernelMode`).
Under whole-transformer CUDA graphs the kernel of the step's phase is part of the graph key (`AttentionGraphs`: one
graph per kernel, each replay counted as its capture ran). Under Ulysses context parallelism diffusers' "native" op
calls SDPA after its all-to-all, on the whole sequence for this rank's heads: the mode answers that call. A whole-model
compile, graphs split at a dynamic cache decision, and ring attention are refused.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import importlib.util
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.nn.functional as F
from loguru import logger
from torch._dynamo.comptime import comptime
from torch.overrides import TorchFunctionMode

from hookkit.core.feature import AttachContext, BaseFeature
from hookkit.core.graphs import GraphDecisions
from hookkit.core.modes import push_mode, remove_mode
from hookkit.core.plan import Attachment, PlanContext, add_hook, flat_blocks, module_at
from hookkit.core.registry import Args, Kwargs, ModelHook
from hookkit.core.removal import Removable
from hookkit.core.summary import FeatureSummary, table
from hookkit.errors import SpecError, UnsupportedError
from hookkit.techniques.attention import fa3_hopper, flashinfer_fa3
from hookkit.techniques.attention.outer_masks import OuterMasks
from hookkit.techniques.attention.spec import LOW_KERNELS, Attention

if TYPE_CHECKING:
    from hookkit.core.state import CallState

NAME = "attention"
BLOCK_HOOK = "hookkit.attention.block"
PHASES = ("first", "middle", "last")

#: kernels that run wherever torch's SDPA runs (CPU included), with every argument SDPA takes
ANY_DEVICE = ("native", "_native_math")
#: kernels that take any SDPA call (mask, dropout, grouped-query heads); the others fall back to "native" for those
TAKES_ALL = ("native", "_native_math", "_native_efficient")
#: the package each kernel imports (module name) and how to install it (the refusal's instruction where it is missing):
#: FA3's has no PyPI package, it is built from source
PACKAGES = {"flash": ("flash_attn", "`pip install flash-attn`"),
            "sage": ("sageattention", "`pip install sageattention`"),
            "hookkit_int8": ("triton", "`pip install triton`"), "hookkit_fp8": ("triton", "`pip install triton`"),
            "flashinfer": ("flashinfer", "`pip install flashinfer-python`"),
            "flashinfer_fp8": ("flashinfer", "`pip install flashinfer-python`"),
            "fa3_fp8": (fa3_hopper.MODULE, "FA3 has no PyPI package: build flash-attention's hopper/ folder "
                                           f"(`{fa3_hopper.BUILD}`)")}
#: kernels that need fp16 or bf16 inputs
HALF_ONLY = ("_native_cudnn", "_native_flash", "flash", "sage", "hookkit_int8", "hookkit_fp8", "flashinfer",
             "flashinfer_fp8", "fa3_fp8")
#: the oldest GPU generation (compute capability) each CUDA-only kernel runs on: int8/bf16 tensor cores, Ampere;
#: fp8 tensor cores, Ada (8.9) and Hopper
MIN_CAPABILITY = {"_native_cudnn": (8, 0), "_native_flash": (8, 0), "_native_efficient": (5, 0), "flash": (8, 0),
                  "sage": (8, 0), "hookkit_int8": (8, 0), "hookkit_fp8": (8, 9), "flashinfer": (9, 0),
                  "flashinfer_fp8": (9, 0), "fa3_fp8": (9, 0)}
#: kernels built for one GPU generation only (compute capability major): FA3's kernels (FlashInfer's port and FA3's
#: own) are sm_90a code (Hopper's warpgroup MMA and TMA), which no other generation runs
ONLY_MAJOR = {"flashinfer": 9, "flashinfer_fp8": 9, "fa3_fp8": 9}
#: FlashInfer's FA3 kernels (`flashinfer_fa3`)
FLASHINFER_KERNELS = ("flashinfer", "flashinfer_fp8")
#: the Hopper fp8 kernels fed `flashinfer_fa3.quantize`'s codes: FlashInfer's port of FA3's e4m3 kernel and FA3's own
#: (`fa3_hopper`); both are taken only on calls of at least `flashinfer_fa3.FP8_MIN_KEYS` keys
HOPPER_FP8_KERNELS = ("flashinfer_fp8", "fa3_fp8")
#: the kernels enable runs once on seeded inputs and refuses where they raise or err too much (`check_hopper_kernel`)
CHECKED_KERNELS = FLASHINFER_KERNELS + ("fa3_fp8",)
#: the head sizes FlashInfer's fp8 kernel is taken at: those whose output a GPU has shown to be the kernel's own
#: arithmetic (`flashinfer_fa3.reference`). On the trained models' heads of 32, zero-padded to 64, it gave 13-18 %
#: error, 6-13x its arithmetic's 1.4-2.2 % (BENCHMARKS.md); 64 and 256 are not yet measured. It is also taken only on
#: calls of at least `flashinfer_fa3.FP8_MIN_KEYS` keys (shorter ones run as "native": it departs from its arithmetic
#: there, cross-attention to a prompt included)
FLASHINFER_FP8_HEADS = (128,)
#: hookkit's own Triton kernels
HOOKKIT_KERNELS = ("hookkit_int8", "hookkit_fp8")


def head_sizes_ok(kernel: str, dim: int) -> bool:
    """Whether `kernel` takes heads of size `dim`."""
    if kernel in HOOKKIT_KERNELS:
        return dim in (32, 64, 128)
    if kernel == "flashinfer_fp8":
        return dim in FLASHINFER_FP8_HEADS
    if kernel == "fa3_fp8":
        return dim in fa3_hopper.HEADS
    if kernel == "flashinfer":
        return flashinfer_fa3.padded_size(dim) is not None
    if kernel == "sage":  # sageattention 1.0.6's kernels
        return dim in (64, 96, 128)
    if kernel in ("_native_cudnn", "_native_flash", "flash"):
        return dim % 8 == 0 and dim <= 256
    return True


def head_size_text(kernel: str) -> str:
    if kernel in HOOKKIT_KERNELS:
        return "32, 64 or 128"
    if kernel == "flashinfer_fp8":
        sizes = " or ".join(map(str, FLASHINFER_FP8_HEADS))
        return f"{sizes} (the sizes a GPU has shown it computes its own arithmetic at)"
    if kernel == "fa3_fp8":
        sizes = " or ".join(map(str, fa3_hopper.HEADS))
        return f"{sizes} (the sizes its kernel is built and measured at)"
    if kernel == "flashinfer":
        return "up to 256"
    return "64, 96 or 128" if kernel == "sage" else "a multiple of 8 up to 256"


# --- the kernels -------------------------------------------------------------------------------------------------


def _sdpa_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False, **bound}


def unsupported(kernel: str, a: dict[str, Any]) -> str | None:
    """Why `kernel` cannot take this SDPA call (it then runs as "native"), or None."""
    if kernel in TAKES_ALL:
        return None
    q, k, v = a["query"], a["key"], a["value"]
    mask = a["attn_mask"]
    if mask is not None and not (kernel in HOOKKIT_KERNELS and mask_ok(mask, q, k)):
        if kernel not in HOOKKIT_KERNELS:
            return "attention mask"
        elsewhere = f", on {mask.device}" if mask.device != q.device else ""
        return f"attention mask ({mask.dtype}, {tuple(mask.shape)}{elsewhere})"
    if a["dropout_p"]:
        return "dropout"
    if a["enable_gqa"] or q.dim() != 4 or q.shape[1] != k.shape[1]:
        return "grouped-query heads"
    if a["is_causal"] and kernel in HOOKKIT_KERNELS:  # FlashInfer's kernels take it: they have a causal mode
        return "causal mask"
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        return f"dtype {q.dtype}"
    if not head_sizes_ok(kernel, q.shape[-1]) or v.shape[-1] != q.shape[-1]:
        return f"head size {q.shape[-1]}"
    if kernel in HOPPER_FP8_KERNELS and k.shape[2] < flashinfer_fa3.FP8_MIN_KEYS:
        return f"fewer than {flashinfer_fa3.FP8_MIN_KEYS} keys"
    if not q.is_cuda:
        return "not on CUDA"
    return None


def mask_ok(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether hookkit's kernels take this SDPA mask for `[B, H, Sq, D]` q and `[B, H, Sk, D]` k: boolean, on q's
    device (the kernel reads it there; SDPA itself names a mismatch), at most 4 dimensions, each the size of SDPA's
    `[B, H, Sq, Sk]` or 1 (broadcast), the last one Sk. Here, not in `fp8_triton`, so that `unsupported` decides
    without importing triton."""
    if mask.dtype != torch.bool or mask.device != q.device or not 0 < mask.dim() <= 4 or q.dim() != 4:
        return False
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return shape[3] == full[3] and all(n in (1, f) for n, f in zip(shape[:3], full[:3], strict=True))


def check_key_counts(kernel: str, q: torch.Tensor, mask: torch.Tensor | None, key_counts: torch.Tensor) -> None:
    """Refuses `key_counts` that hookkit's kernel `kernel` (its module's name) cannot take for `[B, H, Sq, D]` q:
    one int32 count a batch element, on q's device (the kernel reads it there), and no mask beside it."""
    b = q.shape[0]
    if mask is not None or key_counts.dtype != torch.int32 or tuple(key_counts.shape) != (b,) \
            or key_counts.device != q.device:
        raise ValueError(f"{kernel}.attention: key_counts takes no mask and an int32 tensor of shape ({b},) on "
                         f"{q.device}; got mask {None if mask is None else tuple(mask.shape)}, key_counts "
                         f"{key_counts.dtype} {tuple(key_counts.shape)} on {key_counts.device}")


_SDPA_BACKENDS = {"_native_cudnn": "CUDNN_ATTENTION", "_native_flash": "FLASH_ATTENTION",
                  "_native_efficient": "EFFICIENT_ATTENTION", "_native_math": "MATH"}


def _triton_op(name: str, module: str, what: str) -> Any:
    """hookkit's Triton kernel `module.attention` as the op `hookkit::name`: torch.compile keeps it opaque (its fake
    output is q's shape); the module (and triton) is imported at the first call. It takes the kernel's `mask` or its
    `key_counts` (batch element b attending to its first `key_counts[b]` keys: the unmasked kernel, its key loop ending
    at the count)."""

    def kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None,
               mask: torch.Tensor | None = None, key_counts: torch.Tensor | None = None) -> torch.Tensor:
        attention = importlib.import_module(f"hookkit.techniques.attention.{module}").attention
        return attention(query, key, value, scale, mask, key_counts=key_counts)

    kernel.__doc__ = what
    op = torch.library.custom_op(f"hookkit::{name}", kernel, mutates_args=())

    @op.register_fake
    def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None,
          mask: torch.Tensor | None = None, key_counts: torch.Tensor | None = None) -> torch.Tensor:
        return torch.empty_like(query)

    return op


int8_attention = _triton_op("int8_attention", "int8_triton",
                            "hookkit's int8 kernel (int8 Q·Kᵀ, fp16 P·V; boolean masks or key counts)")
fp8_attention = _triton_op("fp8_attention", "fp8_triton",
                           "hookkit's fp8 kernel (int8 Q·Kᵀ, e4m3 P·V; boolean masks or key counts)")


@torch.library.custom_op("hookkit::flashinfer_fp8_attention", mutates_args=())
def flashinfer_fp8_attention(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, q_scale: torch.Tensor,
                             k_scale: torch.Tensor, v_scale: torch.Tensor, sm_scale: float, causal: bool,
                             out_dtype: torch.dtype) -> torch.Tensor:
    """FlashInfer's fp8 kernel on inputs `flashinfer_fa3.quantize` made, as an op torch.compile keeps opaque (the
    quantization before it is traced and fused); flashinfer is imported at the first call."""
    return flashinfer_fa3.run_fp8(q8, k8, v8, q_scale, k_scale, v_scale, sm_scale, causal, out_dtype)


@torch.library.custom_op("hookkit::fa3_fp8_attention", mutates_args=())
def fa3_fp8_attention(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, q_scale: torch.Tensor,
                      k_scale: torch.Tensor, v_scale: torch.Tensor, sm_scale: float, causal: bool,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """FA3's own e4m3 kernel on the inputs `flashinfer_fa3.quantize` made (those FlashInfer's port gets), as an op
    torch.compile keeps opaque; flash_attn_interface is imported at the first call."""
    return fa3_hopper.run_fp8(q8, k8, v8, q_scale, k_scale, v_scale, sm_scale, causal, out_dtype)


def _fp8_fake(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor,
              v_scale: torch.Tensor, sm_scale: float, causal: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """The traced output of both Hopper fp8 ops: the real one's layout, a [B, H, N, D] view of [B, N, H, D]."""
    b, h, n, d = q8.shape
    return q8.new_empty((b, n, h, d), dtype=out_dtype).transpose(1, 2)


flashinfer_fp8_attention.register_fake(_fp8_fake)
fa3_fp8_attention.register_fake(_fp8_fake)


@torch.library.custom_op("hookkit::flashinfer_attention", mutates_args=())
def flashinfer_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sm_scale: float,
                         causal: bool) -> torch.Tensor:
    """FlashInfer's bf16/fp16 kernel as an op torch.compile keeps opaque; flashinfer is imported at the first call."""
    return flashinfer_fa3.run_half(query, key, value, sm_scale, causal)


@flashinfer_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sm_scale: float, causal: bool) -> torch.Tensor:
    b, h, n, d = query.shape  # the real output's layout: a [B, H, N, D] view of [B, N, H, D]
    return query.new_empty((b, n, h, d)).transpose(1, 2)


#: the bf16 and fp8 kernels `flashinfer_fa3.attention` runs for each of its kernel names, as the ops above: the padding
#: and quantization it does around them are traced and fused under compile. "fa3_fp8" runs FA3's own fp8 kernel on
#: the quantization FlashInfer's port gets (its bf16 kernel is never run: no bf16 call has this name)
_HOPPER_OPS = {"flashinfer": (flashinfer_attention, flashinfer_fp8_attention),
               "flashinfer_fp8": (flashinfer_attention, flashinfer_fp8_attention),
               "fa3_fp8": (flashinfer_attention, fa3_fp8_attention)}


def _hopper(kernel: str, a: dict[str, Any]) -> torch.Tensor:
    return flashinfer_fa3.attention(a["query"], a["key"], a["value"], a["scale"], bool(a["is_causal"]),
                                    fp8=kernel != "flashinfer", kernels=_HOPPER_OPS[kernel])


@torch.compiler.disable  # sageattention's Python (asserts, in-place smoothing) stays out of dynamo's graphs
def _sage(a: dict[str, Any]) -> torch.Tensor:
    from sageattention import sageattn

    key = a["key"]
    smoothed = key - key.mean(dim=2, keepdim=True)  # sageattn's own smoothing writes into the caller's key
    return sageattn(a["query"], smoothed, a["value"], tensor_layout="HND", is_causal=a["is_causal"],
                    sm_scale=a["scale"], smooth_k=False)


@torch.compiler.disable
def _flash(a: dict[str, Any]) -> torch.Tensor:
    from flash_attn import flash_attn_func

    q, k, v = (a[n].transpose(1, 2) for n in ("query", "key", "value"))
    return flash_attn_func(q, k, v, softmax_scale=a["scale"], causal=a["is_causal"]).transpose(1, 2)


def run_kernel(kernel: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The SDPA call `func(*args, **kwargs)` by `kernel` (checked by `unsupported` first)."""
    if kernel == "native":
        return func(*args, **kwargs)
    if kernel in _SDPA_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([getattr(SDPBackend, _SDPA_BACKENDS[kernel])]):
            return func(*args, **kwargs)
    a = _sdpa_args(args, kwargs)
    if kernel in HOOKKIT_KERNELS:
        op = int8_attention if kernel == "hookkit_int8" else fp8_attention
        return op(a["query"], a["key"], a["value"], a["scale"], a["attn_mask"])
    if kernel == "sage":
        return _sage(a)
    if kernel in _HOPPER_OPS:
        return _hopper(kernel, a)
    return _flash(a)


#: the outcome `_note_traced` counts for a call site answered with the padding mask taken as its validity row
VALIDITY_ROW = "=validity row"


def run_with_validity_row(kernel: str, a: dict[str, Any], row: torch.Tensor) -> torch.Tensor:
    """The SDPA call `a` (its mask the outer AND of `row`, `[B, 1, 1, S]`: `outer_masks`) by hookkit's `kernel`, the
    rows of the padding queries set to 0, as SDPA gives a row with no allowed key: the same attention, without reading
    an S x S mask.

    Both kernels run unmasked over each batch element's valid keys: K and V reordered so that they come first (a
    stable sort of the row, the identity where they already do, as in HunyuanVideo 1.5's calls; attention does not
    depend on the keys' order), the key loop ending at their count (the op's `key_counts`): no mask tile is classified
    or read, and the fp8 kernel's unmasked launch runs its larger tiles."""
    op = int8_attention if kernel == "hookkit_int8" else fp8_attention
    key, value = a["key"], a["value"]
    valid = row.flatten(1)  # [B, S]: `OuterMasks.take` gives a row of the call's batch and keys
    order = torch.argsort((~valid).to(torch.uint8), dim=1, stable=True)[:, None, :, None]  # valid keys first
    key, value = key.gather(2, order.expand_as(key)), value.gather(2, order.expand_as(value))
    out = op(a["query"], key, value, a["scale"], key_counts=valid.sum(dim=1, dtype=torch.int32))
    return out.masked_fill(~row.transpose(2, 3), 0.0)


class KernelMode(TorchFunctionMode):
    """Answers `F.scaled_dot_product_attention` with one kernel; passes everything else on. One per kernel and
    handle (stable objects: torch.compile guards on the modes on the stack, so a compiled block gets one entry per
    kernel it runs with, chosen again at every call).

    Under torch.compile dynamo traces this mode into the compiled block: `Tensor.unflatten` (a Python method whose
    `super()` call dynamo cannot trace under a mode; diffusers' processors split heads with it) is answered by the
    equivalent `torch.unflatten`, and the per-call bookkeeping (Python counters) is left out of the trace: attention
    calls and fallbacks are counted per call in eager blocks only. What a trace decides is noted once, while dynamo
    traces (`_note_traced`, run by `comptime` at compile time, never by the compiled code): per kernel, the call sites
    it answers and those that fall back with their reason, which the summary shows as the compiled blocks' calls."""

    def __init__(self, kernel: str, shared: _Shared) -> None:
        super().__init__()
        self.kernel = kernel
        self.shared = shared
        #: hookkit's kernels take an outer-AND padding mask as its validity row (`outer_masks`); None for the others
        self.masks = OuterMasks() if kernel in HOOKKIT_KERNELS else None

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.unflatten:
            return torch.unflatten(*args, **kwargs)
        if func is not F.scaled_dot_product_attention:
            out = func(*args, **kwargs)
            if self.masks is not None:
                self.masks.observe(func, args, kwargs, out)
            return out
        traced = torch.compiler.is_compiling()
        a = _sdpa_args(args, kwargs)
        row = None if self.masks is None else self.masks.take(a["attn_mask"], a["query"], a["key"])
        if row is not None and unsupported(self.kernel, {**a, "attn_mask": row}) is not None:
            row = None  # the kernel cannot take the row: the full mask decides as before
        reason = None if row is not None else unsupported(self.kernel, a)
        if traced:  # the locals `_note_traced` reads (constants while dynamo traces)
            outcome = VALIDITY_ROW if row is not None else reason or ""  # noqa: F841
            shared_key, kernel = self.shared.key, self.kernel  # noqa: F841
            comptime(_note_traced)
        if reason is not None:
            if not traced:
                self.shared.record("fallback", (self.kernel, reason))
            return func(*args, **kwargs)
        if not traced:
            self.shared.record("call", (self.kernel,))
            if row is not None:
                self.shared.record("row", (self.kernel,))
        if row is not None:
            return run_with_validity_row(self.kernel, a, row)
        return run_kernel(self.kernel, func, args, kwargs)

    def clear(self) -> None:
        """Forget any mask followed (at each block call: a block that raised may have left one)."""
        if self.masks is not None:
            self.masks.clear()


#: the handles' shared states by `_Shared.key`, for `_note_traced` (which gets constants, not objects, from dynamo)
_TRACING: weakref.WeakValueDictionary[int, _Shared] = weakref.WeakValueDictionary()


def _note_traced(ctx: Any) -> None:
    """At compile time (`comptime`), inside `KernelMode.__torch_function__` while dynamo traces it: count one SDPA
    call site of a compiled block, answered by the kernel (outcome "") or falling back (outcome: the reason). Its own
    failure (a dynamo whose `comptime` context reads locals otherwise) must not fail the user's compile: it is logged
    (once per trace, never per call) and the call site goes uncounted."""
    try:
        key, kernel, outcome = (ctx.get_local(name).as_python_constant()
                                for name in ("shared_key", "kernel", "outcome"))
    except Exception as exc:  # noqa: BLE001 - bookkeeping only: the compile goes on
        logger.warning("attention: a compiled call site was not counted ({}: {})", type(exc).__name__, exc)
        return
    shared = _TRACING.get(key)
    if shared is not None:
        shared.traced[(kernel, outcome)] += 1


# --- per-call state and the hooks ---------------------------------------------------------------------------


@attrs.define
class _Calls:
    """What one generation ran: block calls per (phase, kernel), attention calls per (phase, kernel) answered by a
    kernel other than "native" (which runs unobserved), fallbacks per (phase, kernel, reason), and the attention
    calls whose padding mask was taken as its validity row."""

    block_calls: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    #: attention calls a kernel other than "native" answered, per (phase, kernel)
    attention_calls: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    fallbacks: Counter[tuple[str, str, str]] = attrs.field(factory=Counter)
    #: of the attention calls, those whose outer-AND padding mask the kernel took as its validity row
    #: (`outer_masks`), per (phase, kernel)
    validity_rows: Counter[tuple[str, str]] = attrs.field(factory=Counter)
    steps: dict[str, set[int]] = attrs.field(factory=dict)


class _Shared:
    """What the hooks of one handle share: the attach context (the per-call state), the spec, the per-kernel modes."""

    def __init__(self, ctx: AttachContext, spec: Attention) -> None:
        self.ctx = ctx
        self.spec = spec
        #: this handle's key in `_TRACING`
        self.key = id(self)
        _TRACING[self.key] = self
        #: SDPA call sites traced into compiled blocks, per (kernel, reason it falls back or "" where it answers);
        #: for the handle's life (compiled code outlives a pipeline call)
        self.traced: Counter[tuple[str, str]] = Counter()
        self.modes = {k: KernelMode(k, self) for k in spec.kernels() if k != "native"}
        #: the graph side, once whole-transformer CUDA graphs requested it
        self.graphs: AttentionGraphs | None = None

    def phase(self, state: CallState) -> str:
        spec = self.spec
        if state.step < spec.full_first:
            return "first"
        if state.num_steps is not None and state.step >= state.num_steps - spec.full_last:
            return "last"
        return "middle"

    def step_kernel(self) -> str:
        """The kernel of the blocks `full_blocks` does not keep at `kernel`, at the current step."""
        spec = self.spec
        if spec.low_precision is None or self.phase(self.ctx.state) != "middle":
            return spec.kernel
        return spec.low_precision

    def calls(self) -> _Calls:
        return self.ctx.state.feature(NAME, _Calls)

    def record(self, kind: str, what: tuple[str, ...]) -> None:
        """Count one block call (`kind="block"`, what = (kernel,)), attention call or fallback in the current phase;
        while a graph is warmed up and captured, note it for the graph's replays instead."""
        if self.graphs is not None and self.graphs.forced is not None:
            self.graphs.note(kind, what)
            return
        state = self.ctx.state
        self._count(kind, (self.phase(state), *what), state.step, 1)

    def _count(self, kind: str, key: tuple[str, ...], step: int, n: int) -> None:
        calls = self.calls()
        if kind == "block":
            calls.block_calls[key] += n  # type: ignore[index]
            calls.steps.setdefault(key[0], set()).add(step)
        elif kind == "call":
            calls.attention_calls[key] += n  # type: ignore[index]
        elif kind == "row":
            calls.validity_rows[key] += n  # type: ignore[index]
        else:
            calls.fallbacks[key] += n  # type: ignore[index]


class AttentionGraphs:
    """The kernel choice under whole-transformer CUDA graphs (`hookkit.core.graphs.GraphDecisions`).

    A replayed graph runs the kernels its capture ran and no hook, so the kernel of the step's phase (`step_kernel`)
    is part of the graph key: one graph per kernel. While a graph is warmed up and captured the hooks run the forced
    kernel and note, per block, what they ran (block calls, attention calls, fallbacks) instead of counting it; each
    call a graph serves then counts what its capture noted, in the step's phase, so the summary reads as in eager mode
    (a block the cache skips in that graph counts nothing there either).
    """

    def __init__(self, shared: _Shared) -> None:
        self.shared = shared
        #: the kernel forced while a graph is warmed up and captured, else None
        self.forced: str | None = None
        #: while forced: the block running now (its index in execution order) and what each block ran (warm-up runs
        #: and the capture run the same blocks: each block's entry is rewritten, never added to)
        self.block: int | None = None
        self.blocks: dict[int, Counter[tuple[str, tuple[str, ...]]]] = {}
        #: what the last forced run noted, until the call it served is reported (`replayed`)
        self.pending: dict[int, Counter[tuple[str, tuple[str, ...]]]] | None = None
        #: what each captured graph runs, by its whole decision key and input shapes
        self.ran: dict[Hashable, Counter[tuple[str, tuple[str, ...]]]] = {}

    def decision(self, shapes: Hashable = None) -> str:
        return self.shared.step_kernel()

    @contextlib.contextmanager
    def forcing(self, decision: str) -> Iterator[None]:
        self.forced, self.blocks = decision, {}
        try:
            yield
        finally:
            self.forced, self.block = None, None
            self.pending, self.blocks = self.blocks, {}

    def enter_block(self, index: int) -> None:
        """A block starts while forced: what it runs replaces what an earlier forced run of it noted."""
        self.block = index
        self.blocks[index] = Counter()

    def note(self, kind: str, what: tuple[str, ...]) -> None:
        if self.block is not None:
            self.blocks[self.block][(kind, what)] += 1

    def replayed(self, decision: str, shapes: Hashable = None, graph: Hashable = None) -> None:
        key = (decision if graph is None else graph, shapes)
        if self.pending is not None:  # this call captured its graph: what the capture ran is what it replays
            total: Counter[tuple[str, tuple[str, ...]]] = Counter()
            for noted in self.pending.values():
                total.update(noted)
            self.ran[key], self.pending = total, None
        state = self.shared.ctx.state
        phase = self.shared.phase(state)
        for (kind, what), n in self.ran.get(key, Counter()).items():
            self.shared._count(kind, (phase, *what), state.step, n)

    def adopted(self, shapes: Hashable = None) -> None:
        """A call run eagerly (the first-call check's): the hooks chose and counted as in eager mode."""


class AttentionBlockHook(ModelHook):
    """On each block: runs it under the mode of the kernel chosen for this block at this step."""

    replaces_forward = True

    def __init__(self, shared: _Shared, full: bool, index: int) -> None:
        self.shared = shared
        #: the block runs `kernel` at every step (`full_blocks`)
        self.full = full
        #: the block's place in execution order
        self.index = index

    def kernel(self) -> str:
        shared = self.shared
        if self.full:
            return shared.spec.kernel
        graphs = shared.graphs
        if graphs is not None and graphs.forced is not None:
            return graphs.forced
        return shared.step_kernel()

    def new_forward(self, module: torch.nn.Module, call_next: Callable[..., Any], args: Args, kwargs: Kwargs) -> Any:
        shared = self.shared
        kernel = self.kernel()
        if shared.graphs is not None and shared.graphs.forced is not None:
            shared.graphs.enter_block(self.index)
        shared.record("block", (kernel,))
        mode = shared.modes.get(kernel)
        if mode is None:  # "native": torch's SDPA as it is
            return call_next(*args, **kwargs)
        mode.clear()
        push_mode(mode)
        try:
            return call_next(*args, **kwargs)
        finally:
            remove_mode(mode)
            mode.clear()  # a block that raised leaves no mask held


def _install_graphs(shared: _Shared) -> AttentionGraphs:
    if shared.graphs is None:
        shared.graphs = AttentionGraphs(shared)
    return shared.graphs


# --- enable-time checks ------------------------------------------------------------------------------------------


def _block_full(spec: Attention, blocks: list[tuple[str, Any, torch.nn.Module]], transformer: str) -> list[bool]:
    """Per block (execution order): whether `full_blocks` keeps it at `kernel`."""
    paths = [path for path, _, _ in blocks]
    full = [False] * len(paths)
    for selector in spec.full_blocks:
        if isinstance(selector, int):
            if not -len(paths) <= selector < len(paths):
                raise SpecError(f"Attention.full_blocks: expected block indices in [{-len(paths)}, {len(paths) - 1}] "
                                f"({transformer} has {len(paths)} blocks), got {selector}. Use an index in range or a "
                                "path pattern.")
            full[selector] = True
            continue
        matched = [i for i, p in enumerate(paths) if fnmatch.fnmatchcase(p, selector)]
        if not matched:
            raise SpecError(f"Attention.full_blocks: expected patterns that match block paths of {transformer} "
                            f"({paths[0]} ... {paths[-1]}), got {selector!r}, which matches none. Fix the pattern.")
        for i in matched:
            full[i] = True
    return full


def _attention_modules(block: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(name, m) for name, m in block.named_modules() if "processor" in m.__dict__ or "processor" in m._modules]


def _head_size(module: torch.nn.Module) -> int | None:
    head_dim = getattr(module, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    heads, inner = getattr(module, "heads", None), getattr(module, "inner_dim", None)
    return inner // heads if isinstance(heads, int) and isinstance(inner, int) and heads else None


def _model_dtype(transformer: torch.nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in transformer.parameters() if p.is_floating_point()), None)


def _active_backend() -> str | None:
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    registry = getattr(dispatch, "_AttentionBackendRegistry", None)
    backend = getattr(registry, "_active_backend", None)
    return getattr(backend, "value", backend)


def check_kernels(spec: Attention, transformer: torch.nn.Module, blocks: list[tuple[str, Any, torch.nn.Module]],
                  full: list[bool]) -> None:
    """Refuse, before anything is attached, what a chosen kernel can never run: its package missing, the model's dtype,
    a head size, no CUDA device (or the model not on it), a GPU generation too old, processors that would bypass
    SDPA."""
    model = type(transformer).__name__
    active = _active_backend()
    if active not in (None, "native"):
        raise UnsupportedError(f"Attention: expected diffusers' active attention backend 'native' (hookkit chooses the "
                               f"kernel at torch's SDPA call), got {active!r}. Call "
                               "transformer.set_attention_backend('native') "
                               "(it sets diffusers' active backend too) and leave `attention_backend(...)` / "
                               "DIFFUSERS_ATTN_BACKEND unset while hookkit.Attention is on.")
    for path, _, block in blocks:
        for name, module in _attention_modules(block):
            processor = module.__dict__.get("processor") or module._modules.get("processor")
            backend = getattr(processor, "_attention_backend", None)
            backend = getattr(backend, "value", backend)
            if backend not in (None, "native"):
                raise UnsupportedError(
                    f"Attention: expected the processor of {path}.{name} to dispatch to diffusers' 'native' backend "
                    f"(torch's SDPA, where hookkit chooses the kernel), got {backend!r}. Call "
                    "transformer.set_attention_backend('native') first, and choose the kernel with "
                    "Attention(kernel=...).")
    for kernel in spec.kernels():
        where = "kernel" if kernel == spec.kernel else "low_precision"
        package = PACKAGES.get(kernel)
        if package is not None and importlib.util.find_spec(package[0]) is None:
            raise UnsupportedError(f"Attention.{where}: {kernel!r} needs the {package[0]!r} package, which is not "
                                   f"installed. {package[1]}, or choose another kernel.")
        if kernel in FLASHINFER_KERNELS:
            _check_flashinfer_version(kernel, where)
        if kernel in HALF_ONLY:
            dtype = _model_dtype(transformer)
            if dtype not in (torch.float16, torch.bfloat16):
                raise UnsupportedError(f"Attention.{where}: {kernel!r} expected a float16 or bfloat16 {model}, got "
                                       f"{dtype}. Load the pipeline with torch_dtype=torch.bfloat16, or choose "
                                       "kernel='native'.")
        for (path, _, block), kept in zip(blocks, full):
            if kept and kernel != spec.kernel:
                continue
            for name, module in _attention_modules(block):
                size = _head_size(module)
                if size is not None and not head_sizes_ok(kernel, size):
                    raise UnsupportedError(f"Attention.{where}: {kernel!r} expected heads of size "
                                           f"{head_size_text(kernel)}, got {size} at {path}.{name}. Choose another "
                                           "kernel, or keep the block at `kernel` (Attention.full_blocks).")
        if kernel in ANY_DEVICE:
            continue
        if not torch.cuda.is_available():
            raise UnsupportedError(f"Attention.{where}: {kernel!r} needs a CUDA device; none is available. Use "
                                   "kernel='native' and low_precision=None on this machine.")
        devices = sorted({str(p.device) for p in transformer.parameters()})
        if not all(d.startswith("cuda") for d in devices):
            raise UnsupportedError(f"Attention.{where}: {kernel!r} expected every parameter of {model} on cuda, got "
                                   f"{', '.join(devices)}. Move the pipeline first (pipe.to(\"cuda\")), then call "
                                   "hookkit.enable.")
        device = next(transformer.parameters()).device
        refusal = capability_refusal(kernel, where, torch.cuda.get_device_capability(device),
                                     torch.cuda.get_device_name(device))
        if refusal is not None:
            raise UnsupportedError(refusal)
        if kernel in CHECKED_KERNELS:
            sizes = {_head_size(module) for (_, _, block), kept in zip(blocks, full) if not kept or where == "kernel"
                     for _, module in _attention_modules(block)}
            check_hopper_kernel(kernel, where, sorted(s for s in sizes if s is not None), _model_dtype(transformer),
                                device)


@attrs.frozen
class _Checked:
    """How enable's check (`check_hopper_kernel`) runs one Hopper kernel, and what its logs and refusals say."""

    #: whose kernel it is ("FlashInfer", "FA3")
    owner: str
    #: what `flashinfer_fa3.check` runs as the bf16 and the fp8 kernel (the plain functions: enable runs eagerly)
    kernels: tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]
    #: what the first log line adds: what the kernel's first call does
    first_use: str
    #: what a refusal of a check that raised says was expected ("FlashInfer to build and run its kernel")
    runs: str
    #: what a check that raised a TypeError means, after its message ("" where nothing in particular)
    type_error: str
    #: the fix where the check raised
    raised_fix: str
    #: what computed a wrong output, "{version}" the module's `__version__`
    computed_by: str
    #: the fix where the kernel erred too much
    wrong_fix: str


def _flashinfer_checked(other: str) -> _Checked:
    """FlashInfer's kernel as enable checks it; `other`: the kernel a refusal suggests instead."""
    return _Checked(owner="FlashInfer", kernels=(flashinfer_fa3.run_half, flashinfer_fa3.run_fp8),
                    first_use="; its first use compiles it with nvcc (minutes, cached under ~/.cache/flashinfer) "
                              "unless the package holds it prebuilt",
                    runs="FlashInfer to build and run its kernel", type_error="",
                    raised_fix="FlashInfer compiles the kernel with nvcc at first use: put CUDA's compiler on PATH (or "
                               f"set CUDA_HOME), or choose {other}.",
                    computed_by="FlashInfer {version}",
                    wrong_fix=f"Choose {other}, or install a FlashInfer release from 0.2.14 to 0.7.4.")


_FA3_FIX = ("Choose 'flashinfer_fp8' (FlashInfer's port of the kernel) or 'hookkit_fp8', or rebuild FA3 from "
            f"flash-attention's hopper/ folder (`{fa3_hopper.BUILD}`).")
#: each checked kernel (`CHECKED_KERNELS`) as enable's check runs and words it
_CHECKED = {
    "flashinfer": _flashinfer_checked("'_native_cudnn'"),
    "flashinfer_fp8": _flashinfer_checked("'hookkit_fp8'"),
    "fa3_fp8": _Checked(owner="FA3", kernels=(flashinfer_fa3.run_half, fa3_hopper.run_fp8),
                        first_use=f", built from flash-attention's hopper/ folder ({fa3_hopper.MODULE})",
                        runs=f"FA3's {fa3_hopper.MODULE} to run its e4m3 kernel",
                        type_error=" (a TypeError here: an FA3 build whose flash_attn_func takes no q_descale, "
                                   "k_descale and v_descale, older than its fp8 kernel's per-head descales)",
                        raised_fix=_FA3_FIX, computed_by=f"this FA3 build ({fa3_hopper.MODULE})", wrong_fix=_FA3_FIX),
}


def check_hopper_kernel(kernel: str, where: str, sizes: list[int], dtype: torch.dtype | None,
                        device: torch.device) -> None:
    """Run `kernel` (one of `CHECKED_KERNELS`: FlashInfer's "flashinfer" and "flashinfer_fp8", FA3's own "fa3_fp8")
    once for each head size of `sizes` (at the kernel size it runs at, `flashinfer_fa3.padded_size`), and check what
    it computes there, padding included (`flashinfer_fa3.check`). Why at enable: FlashInfer's first call compiles with
    nvcc (unless the package holds the module prebuilt), so a missing compiler or a failed build is a refusal here,
    with the fix, not an error in the first denoising step; an FA3 build whose call differs from hookkit's (no fp8
    descales) is refused likewise; and a kernel that errs more than `flashinfer_fa3.CHECK_BOUND` allows (NaN included)
    is refused, not run."""
    checked = _CHECKED[kernel]
    fp8 = kernel != "flashinfer"
    dtype = dtype or torch.bfloat16
    for dim in sizes:
        size = flashinfer_fa3.padded_size(dim)
        padded = f", zero-padded to {size}" if size != dim else ""
        logger.info("attention: {}'s {} kernel for heads of {}{} ({}){}", checked.owner, kernel, dim, padded, dtype,
                    checked.first_use)
        try:
            error = flashinfer_fa3.check(dim, dtype, device, fp8=fp8, kernels=checked.kernels)
        except Exception as exc:  # noqa: BLE001 - any failure of the kernel's build or call is the refusal's reason
            reason = (str(exc).strip().splitlines() or [""])[0][:300]
            meaning = checked.type_error if isinstance(exc, TypeError) else ""
            raise UnsupportedError(f"Attention.{where}: {kernel!r} expected {checked.runs} for heads of {dim}{padded} "
                                   f"({dtype}), got {type(exc).__name__}: {reason}{meaning}. "
                                   f"{checked.raised_fix}") from exc
        bound = flashinfer_fa3.CHECK_BOUND[fp8]
        if fp8:
            expected = (f"to err against float32 attention at most {bound}x what its own arithmetic "
                        "(flashinfer_fa3.reference) errs")
            got = f"{error:.3g}x"
        else:
            expected = f"to match float32 attention within a mean relative error of {bound}"
            got = f"{error:.3g}"
        if not error <= bound:  # NaN included
            version = getattr(sys.modules.get(PACKAGES[kernel][0]), "__version__", "unknown")
            raise UnsupportedError(f"Attention.{where}: {kernel!r} expected {checked.owner}'s kernel for heads of "
                                   f"{dim}{padded} ({dtype}) {expected} on each head of enable's check (seeded random "
                                   f"inputs, {flashinfer_fa3.CHECK_TOKENS[fp8]} tokens), got {got}: "
                                   f"{checked.computed_by.format(version=version)} computes something other than "
                                   f"what hookkit's call means. {checked.wrong_fix}")
        logger.info("attention: {}'s {} kernel for heads of {}: its worst head on enable's check {}", checked.owner,
                    kernel, dim, got + (" its arithmetic's error against float32 attention" if fp8
                                        else " mean relative error against float32 attention"))



def capability_refusal(kernel: str, where: str, capability: tuple[int, int], device_name: str) -> str | None:
    """Why `kernel` cannot run on a GPU of this compute capability (the refusal's message), or None."""
    got = f"{capability[0]}.{capability[1]} ({device_name})"
    if capability < MIN_CAPABILITY[kernel]:
        need = ".".join(map(str, MIN_CAPABILITY[kernel]))
        return (f"Attention.{where}: {kernel!r} expected a GPU of compute capability >= {need}, got {got}. Choose "
                "kernel='native' or '_native_efficient'.")
    if kernel in ONLY_MAJOR and capability[0] != ONLY_MAJOR[kernel]:
        other = ("'hookkit_fp8' (compute capability 8.9 and newer) or 'hookkit_int8'" if kernel in LOW_KERNELS
                 else "'_native_cudnn'")
        return (f"Attention.{where}: {kernel!r} expected a Hopper GPU (compute capability {ONLY_MAJOR[kernel]}.x: its "
                f"kernel is sm_90a code), got {got}. Choose {other}.")
    return None


def _check_flashinfer_version(kernel: str, where: str) -> None:
    """Refuse a FlashInfer older than the API `flashinfer_fa3` calls (its FA3 backend's single-sequence call, with fp8
    inputs and per-head scales)."""
    flashinfer = importlib.import_module("flashinfer")
    version = str(getattr(flashinfer, "__version__", "unknown"))
    if not flashinfer_fa3.version_ok(version):
        need = ".".join(map(str, flashinfer_fa3.MIN_VERSION))
        raise UnsupportedError(f"Attention.{where}: {kernel!r} expected flashinfer-python >= {need} (its FA3 "
                               f"backend with fp8 inputs and per-head scales), got {version}. "
                               "`pip install -U flashinfer-python`, or choose another kernel.")


# --- the feature -------------------------------------------------------------------------------------------------


def _steps_text(steps: list[int]) -> str:
    """`[2, 3, 4]` as "2-4"; steps with gaps (the cache skipped blocks at some) listed."""
    if len(steps) > 1 and steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}-{steps[-1]}"
    return ", ".join(map(str, steps))


class _AttentionFeature(BaseFeature):
    """Plugs kernel selection into `hookkit.enable`: `Spec.attention`."""

    name = NAME
    spec_class = Attention

    def plan(self, ctx: PlanContext) -> list[Attachment]:
        spec: Attention = ctx.spec.attention  # type: ignore[assignment]  # planned only when set
        blocks = flat_blocks(ctx.adapter, ctx.transformer)
        full = _block_full(spec, blocks, type(ctx.transformer).__name__)
        check_kernels(spec, ctx.transformer, blocks, full)
        return [Attachment(feature=NAME, target=path, name=BLOCK_HOOK, params=(("full", kept), ("index", i)))
                for i, ((path, _, _), kept) in enumerate(zip(blocks, full))]

    def attach(self, ctx: AttachContext, attachment: Attachment) -> Removable:
        shared: _Shared | None = ctx.kept()
        if shared is None:
            spec: Attention = ctx.spec.attention  # type: ignore[assignment]
            shared = ctx.keep(_Shared(ctx, spec))
            ctx.provide(GraphDecisions, lambda: _install_graphs(shared))
            logger.info("attention: {} on the first {} and last {} steps, {} between, on {} blocks",
                        spec.kernel, spec.full_first, spec.full_last, spec.low_precision or spec.kernel,
                        len(ctx.attachments()))
        hook = AttentionBlockHook(shared, full=attachment.param("full"), index=attachment.param("index"))
        return add_hook(module_at(ctx.transformer, attachment.target), BLOCK_HOOK, hook)

    def summarize(self, ctx: AttachContext) -> FeatureSummary | None:
        spec: Attention = ctx.spec.attention  # type: ignore[assignment]
        calls: _Calls = ctx.state.features.get(NAME) or _Calls()
        phases: dict[str, Any] = {}
        rows: list[list[Any]] = []
        for phase in PHASES:
            kernels = {k: n for (p, k), n in sorted(calls.block_calls.items()) if p == phase}
            steps = sorted(calls.steps.get(phase, ()))
            if not kernels:
                continue
            answered = {k: n for (p, k), n in sorted(calls.attention_calls.items()) if p == phase}
            phases[phase] = {"steps": steps, "block_calls": kernels, "attention_calls": answered}
            rows += [[phase, _steps_text(steps), k, n, answered.get(k, "-" if k == "native" else 0)]
                     for k, n in kernels.items()]
        fallbacks = {f"{p}/{k}/{r}": n for (p, k, r), n in sorted(calls.fallbacks.items())}
        shared: _Shared | None = ctx.kept()
        sites: Counter[tuple[str, str]] = shared.traced if shared else Counter()
        traced: Counter[str] = Counter()
        for (k, r), n in sorted(sites.items()):
            traced[k if r in ("", VALIDITY_ROW) else f"{k}/{r}"] += n
        rows_taken = {"calls": {f"{p}/{k}": n for (p, k), n in sorted(calls.validity_rows.items())},
                      "compiled_call_sites": {k: n for (k, r), n in sorted(sites.items()) if r == VALIDITY_ROW}}
        data = {"kernel": spec.kernel, "low_precision": spec.low_precision, "full_first": spec.full_first,
                "full_last": spec.full_last, "full_blocks": len([a for a in ctx.attachments() if a.param("full")]),
                "phases": phases, "fallbacks": fallbacks, "compiled_call_sites": dict(traced),
                "padding_masks_as_rows": rows_taken}
        text = table(["phase", "steps", "kernel", "block calls", "attention calls"], rows)
        if fallbacks:
            text += "\n" + table(["phase/kernel/reason (ran as 'native')", "attention calls"],
                                 [[k, n] for k, n in fallbacks.items()])
        if traced:
            text += "\n" + table(["compiled blocks: kernel, or kernel/reason (ran as 'native')", "call sites traced"],
                                 [[k, n] for k, n in traced.items()])
        taken = [[f"calls {k}", n] for k, n in rows_taken["calls"].items()]
        taken += [[f"compiled call sites {k}", n] for k, n in rows_taken["compiled_call_sites"].items()]
        if taken:
            text += "\n" + table(["padding masks taken as their validity row", "count"], taken)
        return FeatureSummary(name=NAME, data=data, text=text)


FEATURE = _AttentionFeature()
