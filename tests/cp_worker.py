"""One rank of the 2-process gloo runs of tests/test_parallel.py (not a test module: pytest starts it as a subprocess).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=... python tests/cp_worker.py OUT_DIR SCENARIO

Writes OUT_DIR/rank<N>.json with plain results the tests compare across ranks and against a single process.
Every rank runs the same code on the same tiny Flux (same seed, same inputs). gloo's timeout is short, so a
deadlock (ranks disagreeing on a cache decision) raises here within seconds instead of hanging.

Test-harness workaround, not a fix: diffusers' `enable_parallelism` picks the device as
`rank % torch.accelerator.device_count()`, which is 0 on a CPU build of torch; `one_accelerator_slot()` reports 1
while the mesh is built (diffusers itself is not patched).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import io
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

#: the environment variable that sets gloo's timeout in seconds (default 20)
GLOO_TIMEOUT_VARIABLE = "HOOKKIT_TEST_GLOO_TIMEOUT"


def gloo_timeout_s() -> float:
    """`$HOOKKIT_TEST_GLOO_TIMEOUT` seconds (20 when unset or empty); anything but a number > 0 ends the worker with
    one line naming the variable, not a ValueError traceback in each rank."""
    text = os.environ.get(GLOO_TIMEOUT_VARIABLE, "").strip()
    try:
        seconds = float(text) if text else 20.0
    except ValueError:
        seconds = float("nan")
    if not (seconds > 0 and seconds != float("inf")):
        raise SystemExit(f"{GLOO_TIMEOUT_VARIABLE}={text!r}: expected a number of seconds > 0 (gloo's timeout), got "
                         f"{text!r}. Set e.g. {GLOO_TIMEOUT_VARIABLE}=60, or unset it for 20.")
    return seconds

STEPS = 4


@contextlib.contextmanager
def one_accelerator_slot() -> Iterator[None]:
    """`torch.accelerator.device_count()` is 1 inside (0 on CPU torch, which diffusers divides the rank by)."""
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.accelerator.device_count = original  # type: ignore[assignment]


@contextlib.contextmanager
def cpu_ring_op() -> Iterator[str]:
    """TEST-ONLY attention op for ring attention on the CPU, under the `_native_flash` backend name.

    Ring attention merges each key/value shard's partial result by its log-sum-exp; on the CPU no diffusers backend
    returns one (`native` raises for `return_lse=True`, `_native_flash` needs CUDA). Inside, `_native_flash` dispatches
    to plain math attention (softmax(q k^T * scale) v, and logsumexp of the scores), through diffusers' own ring
    template. Yields the backend name to set. Not shipped: hookkit refuses ring with `native` instead.
    """
    from diffusers.models import attention_dispatch as ad

    def forward_op(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False, return_lse: bool = False, _save_ctx: bool = True,
                   _parallel_config: Any = None) -> Any:
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))  # (B, H, S, D)
        scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        lse = torch.logsumexp(scores, dim=-1)  # (B, H, S)
        out = (torch.softmax(scores, dim=-1) @ v).permute(0, 2, 1, 3)  # (B, S, H, D)
        return (out, lse.permute(0, 2, 1)) if return_lse else out

    def backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                return_lse: bool = False, _parallel_config: Any = None) -> Any:
        if _parallel_config is None:
            return forward_op(None, query, key, value, scale=scale, return_lse=return_lse)
        return ad._templated_context_parallel_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
            forward_op=forward_op, backward_op=None, _parallel_config=_parallel_config)

    name = ad.AttentionBackendName._NATIVE_FLASH
    registry = ad._AttentionBackendRegistry
    saved = registry._backends[name], registry._constraints[name], registry._active_backend
    registry._backends[name], registry._constraints[name] = backend, []
    try:
        yield name.value
    finally:  # `set_attention_backend` also set the process-wide active backend
        registry._backends[name], registry._constraints[name], registry._active_backend = saved


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def pipeline() -> Any:
    from hookkit.tools import zoo

    return zoo.tiny_pipeline("flux")


def call(pipe: Any, **extra: Any) -> torch.Tensor:
    from hookkit.tools import zoo

    kwargs = zoo.call_kwargs("flux", steps=STEPS, **extra)
    device, dtype = pipe.transformer.device, pipe.transformer.dtype
    if device.type != "cpu":  # the GPU scenario: embeddings where the transformer is
        kwargs = {k: v.to(device, dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                  for k, v in kwargs.items()}
    return pipe(**kwargs).images


def parallelise(pipe: Any, ulysses: int = 2, ring: int = 1) -> None:
    from diffusers import ContextParallelConfig

    with one_accelerator_slot():
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring))


def cache_data(handle: Any) -> dict[str, Any]:
    from hookkit.techniques.cache.hooks import NAME

    data = handle.summary().features[NAME].data
    branch = data["branches"][0]
    return {"cached": branch["cached"], "computed": branch["computed"],
            "diffs": {str(k): v for k, v in branch["diffs"].items()}, "collectives": data["collectives"],
            "parallel": data["parallel"]}


def cached_run(spec: Any, order: str, parallel: bool = True) -> dict[str, Any]:
    """A fresh pipeline, hookkit enabled before ("hookkit_first") or after ("cp_first") enable_parallelism."""
    import hookkit

    pipe = pipeline()
    if parallel and order == "cp_first":
        parallelise(pipe)
    handle = hookkit.enable(pipe, spec)
    if parallel and order == "hookkit_first":
        parallelise(pipe)
    out = call(pipe)
    result = cache_data(handle)
    result["digest"] = digest(out)
    hookkit.disable(pipe)
    return result


def local_diff_at_step_1() -> float:
    """This rank's own (unreduced) Fn diff at step 1, as a per-rank decision would see it: DBCache with the
    detection switched off and a threshold every rank passes (all ranks cache alike: no deadlock)."""
    return local_diff_at_step_1_on(pipeline())


def uneven_statistic() -> dict[str, float]:
    from hookkit.core.parallel import ParallelInfo
    from hookkit.techniques.cache.hooks import _CallState, _layout
    import hookkit

    g = torch.Generator().manual_seed(7)
    ref = torch.randn(1, 81, 16, generator=g) * torch.linspace(0.1, 3.0, 81)[None, :, None]  # shards differ in scale
    residual = ref + 0.3 * torch.randn(1, 81, 16, generator=g)
    shard = dist.get_rank()
    mine = residual.tensor_split(2, dim=1)[shard], ref.tensor_split(2, dim=1)[shard]
    layout = _layout(hookkit.DBCache(), 5)
    info = ParallelInfo(group=dist.group.WORLD, rank=shard, world_size=2, ulysses=2, ring=1, anything=True, mesh="world")
    local = _CallState(layout, 4)._diff(*mine)
    ratios = [None, None]
    dist.all_gather_object(ratios, local)
    return {"global": _CallState(layout, 4, info)._diff(*mine), "single": _CallState(layout, 4)._diff(residual, ref),
            "mean_of_ratios": sum(ratios) / 2, "shard_tokens": mine[0].shape[1]}


def module_state(pipe: Any) -> dict[str, Any]:
    """What removal must restore: instance `__dict__` keys of every module and attention processor."""
    modules = {name or "<root>": sorted(m.__dict__) for name, m in pipe.transformer.named_modules()}
    processors = {name: sorted(m.processor.__dict__) for name, m in pipe.transformer.named_modules()
                  if getattr(m, "processor", None) is not None}
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    return {"modules": modules, "processors": processors,
            "active_backend": str(_AttentionBackendRegistry._active_backend)}


def attention_under_ulysses() -> dict[str, Any]:
    """hookkit's kernel choice (`Attention`, the middle steps on "_native_math") with `ContextParallel(ulysses=2)`:
    the SDPA shapes its kernel answered (recorded around `hooks.run_kernel`), the summary's middle steps, and the
    output against the same Attention in one process."""
    import hookkit
    from hookkit.techniques.attention import hooks

    attention = hookkit.Attention(low_precision="_native_math", full_first=1, full_last=1)
    single = pipeline()
    hookkit.enable(single, hookkit.Spec(attention=attention))
    expected = call(single)
    shapes: list[tuple[int, ...]] = []
    real = hooks.run_kernel

    def recording(kernel: str, func: Any, args: Any, kwargs: Any) -> torch.Tensor:
        shapes.append(tuple(hooks._sdpa_args(args, kwargs)["query"].shape))
        return real(kernel, func, args, kwargs)

    hooks.run_kernel = recording
    try:
        pipe = pipeline()
        with one_accelerator_slot():
            handle = hookkit.enable(pipe, hookkit.Spec(attention=attention,
                                                       parallel=hookkit.ContextParallel(ulysses=2)))
        out = call(pipe)
    finally:
        hooks.run_kernel = real
    return {"max_abs_vs_single": (out - expected).abs().max().item(), "digest": digest(out),
            "shapes": sorted(set(shapes)), "middle": handle.summary().features["attention"].data["phases"]["middle"]}


def scenario_ulysses() -> dict[str, Any]:
    import hookkit

    res: dict[str, Any] = {}
    single = call(pipeline())

    # diffusers' context parallelism alone against one process
    pipe = pipeline()
    parallelise(pipe)
    cp = call(pipe)
    res["cp_alone_max_abs"] = (cp - single).abs().max().item()
    res["cp_alone_digest"] = digest(cp)

    # Spec(parallel=...) on a transformer diffusers already parallelised: refused, nothing attached
    try:
        hookkit.enable(pipe, hookkit.Spec(parallel=hookkit.ContextParallel(ulysses=2)))
        res["already_parallel_error"] = None
    except Exception as exc:  # noqa: BLE001 - the test reads type and message
        res["already_parallel_error"] = f"{type(exc).__name__}: {exc}"
    res["already_parallel_left_no_handle"] = hookkit.handle_of(pipe) is None

    # hookkit Spec() (bookkeeping only) on top, then disabled: CP output unchanged, CP still working
    handle = hookkit.enable(pipe, hookkit.Spec())
    res["spec_empty_equal"] = torch.equal(call(pipe), cp)
    handle.remove()
    res["after_disable_equal"] = torch.equal(call(pipe), cp)

    res["attention"] = attention_under_ulysses()

    # static mask: no statistic, no collective; both orders
    static = hookkit.Spec(cache=hookkit.DBCache(steps_mask=[1, 1, 0, 1], mask_policy="static"))
    res["static_single"] = cached_run(static, "", parallel=False)
    for order in ("hookkit_first", "cp_first"):
        res[f"static_{order}"] = cached_run(static, order)

    # the calibrated rules plan the call before it starts: the same steps on every rank as in one process, no
    # collective. Magnitude: ratios 1, retention 2, K 1 -> (1, 1, 0, 1); schedule: 3 of 4 steps from a gram matrix
    calibration = hookkit.CacheCalibration(steps=4, ratios=[1.0] * 4,
                                           gram=[[1.0, 0.5, 0.2, 0.1], [0.5, 1.0, 0.5, 0.2], [0.2, 0.5, 1.0, 0.9],
                                                 [0.1, 0.2, 0.9, 1.0]])
    for rule, cache in (("magnitude", hookkit.DBCache(rule="magnitude", calibration=calibration, threshold=0.5,
                                                       warmup_steps=2, max_continuous_cached_steps=1)),
                        ("schedule", hookkit.DBCache(rule="schedule", calibration=calibration, speedup=1.3,
                                                     taylorseer_order=1)),
                        ("default", hookkit.DBCache(speedup=1.3)),  # calibration-free: 3 of 4 steps, (1, 1, 0, 1)
                        # the same plan, the transformer's gathered output extrapolated on every rank alike
                        ("output", hookkit.DBCache(speedup=1.3, extrapolate="output"))):
        res[f"{rule}_single"] = cached_run(hookkit.Spec(cache=cache), "", parallel=False)
        res[f"{rule}_hookkit_first"] = cached_run(hookkit.Spec(cache=cache), "hookkit_first")

    # dynamic threshold halfway between the two ranks' local step-1 diffs: per-rank decisions would disagree
    local = local_diff_at_step_1()
    locals_ = [None] * dist.get_world_size()
    dist.all_gather_object(locals_, local)
    threshold = (min(locals_) + max(locals_)) / 2
    res["local_diffs_step1"] = locals_
    res["threshold"] = threshold
    dynamic = hookkit.Spec(cache=hookkit.DBCache(threshold=threshold, warmup_steps=1))
    res["dynamic_single"] = cached_run(dynamic, "", parallel=False)
    for order in ("hookkit_first", "cp_first"):
        res[f"dynamic_{order}"] = cached_run(dynamic, order)

    # ring over 2 ranks with the test-only CPU op: CP alone against one process, and the dynamic decisions
    reference = pipeline()  # one process, the same cache spec: what the ring run must reproduce
    hookkit.enable(reference, dynamic)
    cached_single = call(reference)
    hookkit.disable(reference)
    with cpu_ring_op() as backend:
        pipe = pipeline()
        before = module_state(pipe)
        with one_accelerator_slot():
            handle = hookkit.enable(pipe, hookkit.Spec(parallel=hookkit.ContextParallel(ring=2, attention_backend=backend),
                                                       cache=dynamic.cache))
        out = call(pipe)
        res["ring"] = {**cache_data(handle), "digest": digest(out), "max_abs_vs_single": (out - cached_single).abs().max().item(),
                       "backend": handle.summary().features["parallel"].data["attention_backend"]}
        hookkit.disable(pipe)
        # the backend hookkit set (on every processor and process-wide) is undone with the rest
        res["ring"]["removal_state_equal"] = module_state(pipe) == before

    # uneven shards (what ulysses_anything makes: 81 tokens as 41 + 40): DBCache's statistic on this rank's shard,
    # reduced over the group, against the one-process value on the whole tensors (gloo cannot gather uneven
    # outputs at the end of a real call, so the statistic is checked on its own)
    res["uneven"] = uneven_statistic()

    # the same through Spec(parallel=...): hookkit calls diffusers' API and undoes it on removal
    pipe = pipeline()
    before = module_state(pipe)
    with one_accelerator_slot():
        handle = hookkit.enable(pipe, hookkit.Spec(parallel=hookkit.ContextParallel(ulysses=2),
                                                   cache=hookkit.DBCache(threshold=threshold, warmup_steps=1)))
    out = call(pipe)
    res["spec_parallel"] = {**cache_data(handle), "digest": digest(out),
                            "summary": handle.summary().features["parallel"].data}
    res["spec_parallel_text"] = str(handle.summary())
    try:
        call(pipe, height=36, width=36)  # 9 x 9 = 81 image tokens: 2 ranks do not divide them
        res["odd_sequence_error"] = None
    except Exception as exc:  # noqa: BLE001 - the test reads type and message
        res["odd_sequence_error"] = f"{type(exc).__name__}: {exc}"
    hookkit.disable(pipe)
    res["removal_state_equal"] = module_state(pipe) == before
    res["removal_parallel_config"] = "_parallel_config" in pipe.transformer.__dict__
    res["after_removal_equal_single"] = torch.equal(call(pipe), single)
    return res


def scenario_cli() -> dict[str, Any]:
    """`hookkit generate` and `hookkit bench` with --parallel, as torchrun would start them (the group is up)."""
    from hookkit.tools import cli

    out_dir = Path(sys.argv[1])
    res: dict[str, Any] = {}
    for name, argv in (
        ("generate", ["generate", "flux", "--parallel", "ulysses=2", "--steps", "4", "--cache", "--cache-warmup", "1",
                      "--cache-threshold", "0.3", "--cache-max-continuous", "-1", "--cache-taylorseer", "0",
                      "--warmup", "0", "--out", str(out_dir / "flux.png")]),
        ("bench", ["bench", "--model", "flux", "--parallel", "ulysses=2", "--configs", "eager,hookkit-cache-fast",
                   "--steps", "4", "--runs", "1", "--warmup", "0", "--json", str(out_dir / f"bench.json")]),
    ):
        stdout = io.StringIO()
        with one_accelerator_slot(), contextlib.redirect_stdout(stdout):
            res[f"{name}_rc"] = cli.main(argv)
        res[f"{name}_stdout"] = stdout.getvalue()
    return res


def scenario_gpu() -> dict[str, Any]:
    """2 GPUs over NCCL: the tiny Flux in bfloat16, dynamic threshold between the ranks' local diffs, Ulysses with
    the native backend and ring with cuDNN (whose op returns the log-sum-exp ring attention needs)."""
    import hookkit

    device = torch.device("cuda", dist.get_rank())
    res: dict[str, Any] = {}

    def gpu_pipeline() -> Any:
        return pipeline().to(device=device, dtype=torch.bfloat16)

    single_pipe = gpu_pipeline()
    local = local_diff_at_step_1_on(gpu_pipeline())
    locals_ = [None] * dist.get_world_size()
    dist.all_gather_object(locals_, local)
    threshold = (min(locals_) + max(locals_)) / 2
    res["local_diffs_step1"], res["threshold"] = locals_, threshold
    spec = hookkit.Spec(cache=hookkit.DBCache(threshold=threshold, warmup_steps=1))
    handle = hookkit.enable(single_pipe, spec)
    single = call(single_pipe)
    res["single"] = cache_data(handle)
    for name, cp in (("ulysses", hookkit.ContextParallel(ulysses=2)),
                     ("ring", hookkit.ContextParallel(ring=2, attention_backend="_native_cudnn"))):
        pipe = gpu_pipeline()
        handle = hookkit.enable(pipe, hookkit.Spec(parallel=cp, cache=spec.cache))
        out = call(pipe)
        res[name] = {**cache_data(handle), "digest": digest(out.float().cpu()),
                     "max_abs_vs_single": (out.float() - single.float()).abs().max().item()}
        hookkit.disable(pipe)

    # SkyReels-V2 by its adapter's [[cp_plan]] (no `_cp_plan` in diffusers 0.42.1), Ulysses and ring
    sky_single = call_sky(sky_pipeline().to(device=device, dtype=torch.bfloat16)).float()
    for name, cp in (("sky_ulysses", hookkit.ContextParallel(ulysses=2)),
                     ("sky_ring", hookkit.ContextParallel(ring=2, attention_backend="_native_cudnn"))):
        pipe = sky_pipeline().to(device=device, dtype=torch.bfloat16)
        handle = hookkit.enable(pipe, hookkit.Spec(parallel=cp))
        out = call_sky(pipe).float()
        res[name] = {"digest": digest(out.cpu()), "plan_origin": handle.summary().features["parallel"].data["plan_origin"],
                     "relative_max_abs_vs_single": ((out - sky_single).abs().max() / sky_single.abs().max()).item()}
        hookkit.disable(pipe)
    return res


def local_diff_at_step_1_on(pipe: Any) -> float:
    """`local_diff_at_step_1` for a given (GPU) pipeline, parallelised here with Ulysses 2."""
    import hookkit
    from hookkit.techniques.cache import hooks

    parallelise(pipe)
    original = hooks.parallel_info
    hooks.parallel_info = lambda module: None  # type: ignore[assignment]
    try:
        handle = hookkit.enable(pipe, hookkit.Spec(cache=hookkit.DBCache(threshold=100.0, warmup_steps=1)))
        call(pipe)
        diff = cache_data(handle)["diffs"]["1"]
        hookkit.disable(pipe)
    finally:
        hooks.parallel_info = original  # type: ignore[assignment]
    return diff


def sky_pipeline() -> Any:
    """A tiny SkyReels-V2 text-to-video pipeline (diffusers 0.42.1 ships the class without `_cp_plan`; the shipped
    adapter adapters/skyreelsv2.toml has one), on zoo's tiny Wan VAE and scheduler. Head dim 16: cuDNN attention (the
    GPU ring run) takes multiples of 8."""
    import diffusers
    from hookkit.tools import zoo

    wan = zoo.tiny_pipeline("wan")
    torch.manual_seed(0)
    transformer = diffusers.SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
        text_dim=zoo.TINY_CONFIGS["wan"]["text_dim"], freq_dim=32, ffn_dim=32, num_layers=3, rope_max_seq_len=32).eval()
    pipe = diffusers.SkyReelsV2Pipeline(tokenizer=None, text_encoder=None, vae=wan.vae, scheduler=wan.scheduler,
                                        transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_sky(pipe: Any, **extra: Any) -> torch.Tensor:
    """32 x 32 pixels, 5 frames: 2 latent frames of 2 x 2 tokens, 8 tokens (4 per rank)."""
    from hookkit.tools import zoo

    kwargs = zoo.call_kwargs("wan", steps=STEPS, **{"height": 32, "width": 32, **extra})
    device, dtype = pipe.transformer.device, pipe.transformer.dtype
    if device.type != "cpu":  # the GPU scenario: embeddings where the transformer is
        kwargs = {k: v.to(device, dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                  for k, v in kwargs.items()}
    return pipe(**kwargs).frames


def error_of(fn: Any) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads type and message
        return f"{type(exc).__name__}: {exc}"
    return None


def scenario_adapter_plan() -> dict[str, Any]:
    """SkyReels-V2 under Ulysses 2 by its adapter's [[cp_plan]]: against one process, with a static DBCache mask,
    removal, an odd sequence, and a plan whose gather dim is wrong (hookkit refuses; diffusers alone does not)."""
    import attrs

    import hookkit
    from hookkit.adapters import CPGather, get_adapter

    res: dict[str, Any] = {}
    cp = hookkit.ContextParallel(ulysses=2)
    static = hookkit.DBCache(steps_mask=[1, 1, 0, 1], mask_policy="static")
    single = call_sky(sky_pipeline())
    reference = sky_pipeline()
    handle = hookkit.enable(reference, hookkit.Spec(cache=static))
    single_static = call_sky(reference)
    res["static_single"] = cache_data(handle)["cached"]
    hookkit.disable(reference)

    pipe = sky_pipeline()
    before = module_state(pipe)
    with one_accelerator_slot():
        handle = hookkit.enable(pipe, hookkit.Spec(parallel=cp))
    out = call_sky(pipe)
    res["cp_max_abs"] = (out - single).abs().max().item()
    res["cp_digest"] = digest(out)
    res["summary"] = {k: v for k, v in handle.summary().features["parallel"].data.items() if k != "mesh"}
    res["summary_text"] = str(handle.summary())
    # the plan went to diffusers as an argument: neither the class nor the instance carries it
    res["plan_not_on_class_or_instance"] = (type(pipe.transformer)._cp_plan is None
                                            and "_cp_plan" not in pipe.transformer.__dict__)
    res["odd_sequence_error"] = error_of(lambda: call_sky(pipe, height=48, width=48, num_frames=1))  # 9 tokens
    hookkit.disable(pipe)
    res["removal_state_equal"] = module_state(pipe) == before
    res["removal_parallel_config"] = "_parallel_config" in pipe.transformer.__dict__
    res["after_removal_equal_single"] = torch.equal(call_sky(pipe), single)

    pipe = sky_pipeline()
    with one_accelerator_slot():
        handle = hookkit.enable(pipe, hookkit.Spec(parallel=cp, cache=static))
    out = call_sky(pipe)
    res["static"] = {"cached": cache_data(handle)["cached"], "collectives": cache_data(handle)["collectives"],
                     "max_abs_vs_single": (out - single_static).abs().max().item(), "digest": digest(out)}
    hookkit.disable(pipe)
    res["static"]["removal_state_equal"] = module_state(pipe) == before

    # hookkit's registry on blocks.0 before diffusers' split hook (diffusers' then wraps hookkit's): the first-call
    # observer sees the block's input already cut, and must not cut it again
    from hookkit.core.registry import HookRegistry, ModelHook

    pipe = sky_pipeline()
    block0 = pipe.transformer.blocks[0]
    HookRegistry.of(block0).register("test.noop", ModelHook())
    with one_accelerator_slot():
        pipe.transformer.enable_parallelism(config=cp.diffusers_config(),
                                            cp_plan=get_adapter("skyreelsv2").diffusers_cp_plan())
    handle = hookkit.enable(pipe, hookkit.Spec())
    res["inner_registry"] = {"hookkit_outermost": HookRegistry.of(block0).outermost,
                             "max_abs_vs_single": (call_sky(pipe) - single).abs().max().item(),
                             "first_call": handle.summary().first_call}
    hookkit.disable(pipe)

    # Wan's own `_cp_plan` also splits at blocks.0: the first-call check must compare what the block's forward gets
    from hookkit.tools import zoo

    wan_kwargs = zoo.call_kwargs("wan", steps=2, height=32, width=32)
    wan_single = zoo.tiny_pipeline("wan")(**wan_kwargs).frames
    pipe = zoo.tiny_pipeline("wan")
    with one_accelerator_slot():
        handle = hookkit.enable(pipe, hookkit.Spec(parallel=cp))
    res["wan_class_plan"] = {"max_abs_vs_single": (pipe(**zoo.call_kwargs("wan", steps=2, height=32, width=32)).frames
                                                   - wan_single).abs().max().item(),
                             "plan_origin": handle.summary().features["parallel"].data["plan_origin"]}
    hookkit.disable(pipe)

    # a wrong plan: proj_out gathered along its channels (dim 2) instead of its tokens (dim 1)
    shipped = get_adapter("skyreelsv2")
    wrong = attrs.evolve(shipped, name="skyreelsv2", cp_plan=tuple(
        attrs.evolve(e, gather=(CPGather(gather_dim=2, expected_dims=3),)) if e.gather else e for e in shipped.cp_plan))
    pipe = sky_pipeline()
    with one_accelerator_slot():
        pipe.transformer.enable_parallelism(config=cp.diffusers_config(), cp_plan=wrong.diffusers_cp_plan())
    out = call_sky(pipe)  # diffusers alone: a sample of the right shape, scrambled
    res["wrong_plan_diffusers_alone"] = {"same_shape": list(out.shape) == list(single.shape),
                                         "max_abs_vs_single": (out - single).abs().max().item()}
    # ... and one whose gathered output has fewer dims than the plan says (diffusers ignores a gather's expected_dims)
    four_dims = attrs.evolve(shipped, cp_plan=tuple(
        attrs.evolve(e, gather=(CPGather(gather_dim=1, expected_dims=4),)) if e.gather else e for e in shipped.cp_plan))
    try:
        for key, adapter in (("wrong_plan", wrong), ("four_dims_plan", four_dims)):
            hookkit.register_adapter(adapter, replace=True)
            pipe = sky_pipeline()
            before = module_state(pipe)
            with one_accelerator_slot():
                hookkit.enable(pipe, hookkit.Spec(parallel=cp))
            res[f"{key}_error"] = error_of(lambda: call_sky(pipe))
            hookkit.disable(pipe)
            res[f"{key}_removal_state_equal"] = module_state(pipe) == before
    finally:
        hookkit.register_adapter(shipped, replace=True)
    return res


SCENARIOS = {"ulysses": scenario_ulysses, "cli": scenario_cli, "gpu": scenario_gpu, "adapter_plan": scenario_adapter_plan}


def main() -> None:
    out_dir, name = Path(sys.argv[1]), sys.argv[2]
    timeout_s = gloo_timeout_s()  # before joining the group
    if name == "gpu":
        torch.cuda.set_device(int(os.environ["RANK"]))
    dist.init_process_group("nccl" if name == "gpu" else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = SCENARIOS[name]()
        (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
