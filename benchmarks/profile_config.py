"""Where one `hookkit bench` configuration spends a pipeline call: device kernels or the host.

Builds the configuration exactly as `hookkit bench-one` does, warms up, then profiles one call with
`torch.profiler` and prints the wall time, the summed device (kernel) time, the number of kernel launches, the
operators' time by group (step_profile.py's groups: attention, activation quantization, GEMMs, RoPE,
norms+modulation, other; device kernels on a GPU, host operators on the CPU) and the operators by self device time
and by self host time. A call whose wall time is well above its kernel time is
host-bound: the GPU waits for launches. A configuration that cannot run here (the default, fp8, needs CUDA) or a
hookkit refusal ends in one line and exit status 2, not a traceback.

    python benchmarks/profile_config.py --model flux --size 512 --config hookkit-fp8+compile --warmup 3
    python benchmarks/profile_config.py --model wan --arch wan2.1-14b --height 480 --width 832 --frames 81 \
        --steps 2 --warmup 1 --config hookkit-fp8+compile+flashinfer-fp8-attention
    python benchmarks/profile_config.py --model flux --tiny --config hookkit-compile    # CPU: checks the script
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_profile import group_ms, kernels_of

from hookkit.errors import HookkitError, UnsupportedError
from hookkit.tools import bench

SCRIPT = "profile_config.py"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="flux")
    p.add_argument("--size", type=int, default=512, help="height and width unless --height/--width (default 512)")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None, help="video frames (default: the pipeline's, 81 for Wan)")
    p.add_argument("--arch", default=None, help="the full-size architecture of the family (`hookkit bench --help`)")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--config", default="hookkit-fp8+compile", choices=sorted(bench.CONFIGS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--tiny", action="store_true", help="tiny model on this machine's default device, 4 steps")
    args = p.parse_args(argv)

    if not args.tiny:
        bench.require_cuda(SCRIPT, "--tiny checks the script on the CPU with the tiny model.")
    try:
        opts = bench.ModelOptions(name=args.model, steps=4, frames=args.frames) if args.tiny else bench.ModelOptions(
            name=args.model, full=True, steps=args.steps, height=args.height or args.size,
            width=args.width or args.size, frames=args.frames, arch=args.arch)
        device = bench.resolve_device(opts.device)
        reason = bench.CONFIGS[args.config].unavailable(device, bench.available_fields())
        if reason is not None:
            raise UnsupportedError(f"--config {args.config}: {reason} (this run: {device.type}). Pick one that runs "
                                   "here (`hookkit bench --list`), e.g. --config hookkit-compile.")
        profile(args, opts, device)
    except HookkitError as exc:
        print(f"{SCRIPT}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def profile(args: argparse.Namespace, opts: bench.ModelOptions, device: torch.device) -> None:
    """Build, warm up and profile one call of `args.config`; print the summary and the operator tables."""
    pipe = bench.load_pipeline(opts)
    ctx = bench.RunContext(pipe=pipe, opts=opts)
    bench.CONFIGS[args.config].setup(ctx)
    output_type = bench.output_type_for(opts)
    call = lambda: bench.output_of(pipe(**bench.call_kwargs(pipe, opts, output_type)))
    warm = [round(bench.timed(call, device)[0], 3) for _ in range(args.warmup)]
    wall = bench.timed(call, device)[0]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        call()
        bench.synchronize(device)
        profiled = time.perf_counter() - t0
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                          "cuLaunchKernelEx", "cudaGraphLaunch"))
    size = "tiny" if args.tiny else f"{opts.height}x{opts.width}"
    frames = f", {opts.frames} frames" if opts.frames else ""
    print(f"{args.config} on {opts.name} ({size}{frames}, {opts.num_steps()} steps), {bench.device_description(device)}")
    print(f"warm-up calls s: {warm}; timed call: {wall:.3f} s; profiled call: {profiled:.3f} s")
    print(f"device kernel time: {kernel_us / 1e6:.3f} s ({kernel_us / 1e4 / max(profiled, 1e-9):.0f} % of the "
          f"profiled call); launches: {launches}")
    print(by_group(events, device.type == "cuda"))
    if device.type == "cuda":
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


def by_group(events: Any, kernels: bool) -> str:
    """One line: the summed self time (ms) of each of step_profile.py's groups, every group named (0.00 where none
    ran). `kernels`: the device kernels (a GPU run); else the host `aten::` operators (the CPU, where the operators are
    the work)."""
    totals = group_ms(kernels_of(events, kernels))
    what = "device kernel" if kernels else "host operator"
    return f"{what} ms by group: " + ", ".join(f"{group} {ms:.2f}" for group, ms in totals.items())


if __name__ == "__main__":
    raise SystemExit(main())
