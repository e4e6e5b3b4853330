"""Where a pipeline call's time goes: GPU kernels, gaps inside the GPU's work, and the host.

Why: a synchronized step time (`step_profile.py`) mixes host work before the graph launch with the GPU's; a
pipeline call overlaps the two, except where the host is the slower side (DBCache's cached steps: one block of
GPU work, the whole host path). This script splits one `hookkit bench` configuration's pipeline call three ways,
in one process:

- **wall**: the call as `hookkit bench` times it (synchronized before and after), median of `--runs`;
- **GPU only**: from transformer call `--sleep-at` (default 1: after the prologue's and the first step's host
  syncs) on, the call queued behind a sleep kernel long enough for the host to enqueue the rest first (no host
  sync in the loop assumed, and checked: the host's time must end inside the sleep), so the events around it
  time the GPU's work alone, gaps between kernels included; beside it the same span of a normal call, whose
  excess is time the GPU waited for the host. Under whole-transformer CUDA graphs the host cannot run ahead (a
  graph launch returns only when the previous graph has nearly finished, as BENCHMARKS.md measured), so there the
  JSON says `gpu_only_valid: false` and the per-call GPU times of the normal call are the measure;
- **kernels**: the sum of kernel times of one profiled call (torch.profiler), and their count.

Per transformer call (a forward pre-hook on the transformer records a CUDA event and the host clock):
the GPU time between consecutive calls, in a normal call and in the GPU-only one (the difference is time the
GPU waited for the host), and the host time between calls when the host runs ahead (its own cost per step).

    python benchmarks/pipeline_split.py --model qwenimage --size 1024 --config hookkit-fp8-mod+cache-fast+cuda-graphs
    python benchmarks/pipeline_split.py --quick      # CPU: the tiny model, wall time and host times only

JSON (one file per configuration, `pipeline_split_<config>.json` with '+' as '_') and a markdown row under --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hookkit.tools import bench


class CallClock:
    """A forward pre-hook on the transformer: the host clock and (on CUDA) an event at every call's start.

    With `sleep_at` set, the call of that index first queues a sleep kernel of `cycles` (before its event), so
    that the host runs ahead of the GPU from there on: the prologue's host syncs (Qwen-Image's text lengths,
    the scheduler's first step-index search) are behind it.
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.sleep_at: int | None = None
        self.cycles = 0
        self.host: list[float] = []
        self.events: list[Any] = []

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if self.cuda and len(self.host) == self.sleep_at:
            torch.cuda._sleep(self.cycles)
        self.host.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)

    def reset(self) -> None:
        self.host, self.events = [], []


def sleep_cycles_per_ms() -> float:
    """Clock cycles of `torch.cuda._sleep` per millisecond on this GPU (measured, so the sleep is long enough)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(200_000_000)
    end.record()
    end.synchronize()
    return 200_000_000 / start.elapsed_time(end)


def intervals_ms(clock: CallClock, end_event: Any | None, end_host: float) -> tuple[list[float], list[float]]:
    """(GPU ms, host ms) from each transformer call's start to the next one's (the last to the call's end)."""
    host = [1e3 * (b - a) for a, b in zip(clock.host, [*clock.host[1:], end_host])]
    if not clock.events:
        return [], host
    events = [*clock.events, end_event]
    return [a.elapsed_time(b) for a, b in zip(events, events[1:])], host


def kernel_profile(call: Any) -> dict[str, Any]:
    """Kernel time and count of one profiled call (CUDA activity only)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.self_device_time_total > 0]
    return dict(kernel_ms=sum(e.self_device_time_total for e in kernels) / 1e3,
                kernel_count=sum(e.count for e in kernels))


def measure(config: bench.BenchConfig, opts: bench.ModelOptions, runs: int, warmup: int,
            sleep_ms: float, sleep_at: int) -> dict[str, Any]:
    """One configuration's row: a fresh pipeline set up as `hookkit bench-one` sets it up, warmed up, then `runs`
    timed calls with the per-call clock, the GPU-only calls and one profiled call (CUDA), the hookkit summary."""
    device = bench.resolve_device(opts.device)
    cuda = device.type == "cuda"
    row: dict[str, Any] = dict(config=config.name, model=opts.name, height=opts.height, steps=opts.num_steps())
    pipe = bench.load_pipeline(opts)
    ctx = bench.RunContext(pipe=pipe, opts=opts)
    config.setup(ctx)
    output_type = bench.output_type_for(opts)

    kwargs = bench.call_kwargs(pipe, opts, output_type)  # built once, outside every timing (as `hookkit bench` does)

    def call() -> Any:
        return bench.output_of(pipe(**{**kwargs, "generator": torch.Generator().manual_seed(opts.seed)}))

    for _ in range(warmup):
        call()
    bench.synchronize(device)
    clock = CallClock(cuda)
    hook = pipe.transformer.register_forward_pre_hook(clock, with_kwargs=True)
    try:
        walls, gpu_steps, host_steps = [], [], []
        for _ in range(runs):
            clock.reset()
            bench.synchronize(device)
            t0 = time.perf_counter()
            call()
            end_host = time.perf_counter()
            end = None
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
            bench.synchronize(device)
            walls.append(time.perf_counter() - t0)
            gpu, host = intervals_ms(clock, end, end_host)
            gpu_steps.append(gpu)
            host_steps.append(host)
        row.update(wall_s=statistics.median(walls), wall_all_s=walls,
                   gpu_per_call_ms=_median_lists(gpu_steps), host_per_call_ms=_median_lists(host_steps))
        if cuda:
            row.update(gpu_only(call, clock, runs, sleep_ms, sleep_at))
            row["wall_span_s"] = sum(row["gpu_per_call_ms"][sleep_at:]) / 1e3  # the same span, normal call
            row["waiting_for_host_ms"] = 1e3 * (row["wall_span_s"] - row["gpu_only_span_s"])
            # from the call's start until the GPU reached the first transformer call (medians of runs: approximate)
            row["prologue_ms"] = 1e3 * row["wall_s"] - sum(row["gpu_per_call_ms"])
            row.update(kernel_profile(call))
    finally:
        hook.remove()
    row["features"] = bench._summary_data(ctx.handle) if ctx.handle is not None else {}
    return row


def gpu_only(call: Any, clock: CallClock, runs: int, sleep_ms: float, sleep_at: int) -> dict[str, Any]:
    """The calls from transformer call `sleep_at` on, queued behind a sleep kernel: the GPU's time alone, and
    the host's own time per transformer call (it runs ahead); the same span of a normal call beside it."""
    clock.cycles, clock.sleep_at = int(sleep_ms * sleep_cycles_per_ms()), sleep_at
    spans, hosts, gpu_steps, host_steps = [], [], [], []
    try:
        for _ in range(runs):
            clock.reset()
            torch.cuda.synchronize()
            call()
            end_host = time.perf_counter()
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            spans.append(clock.events[sleep_at].elapsed_time(end) / 1e3)
            hosts.append(end_host - clock.host[sleep_at])
            gpu, host = intervals_ms(clock, end, end_host)
            gpu_steps.append(gpu)
            host_steps.append(host)
    finally:
        clock.sleep_at = None
    valid = max(hosts) * 1e3 < 0.9 * sleep_ms
    return dict(sleep_at=sleep_at, gpu_only_span_s=statistics.median(spans), gpu_only_span_all_s=spans,
                host_span_s=statistics.median(hosts), gpu_only_valid=valid,
                gpu_only_note="" if valid else f"the host took {max(hosts) * 1e3:.0f} ms from call {sleep_at} on, more "
                                               f"than 90 % of the {sleep_ms:.0f} ms sleep (a host sync in the loop?)",
                gpu_only_per_call_ms=_median_lists(gpu_steps), host_ahead_per_call_ms=_median_lists(host_steps))


def _median_lists(lists: list[list[float]]) -> list[float]:
    """Element-wise median of equally long lists (one per run)."""
    return [statistics.median(values) for values in zip(*lists)] if lists and lists[0] else []


def markdown(row: dict[str, Any]) -> str:
    """One table row: the whole call, then the span from the sleep's call on split into GPU-only and waiting."""
    def ms(key: str, scale: float = 1.0) -> str:
        value = row.get(key)
        if key in ("gpu_only_span_s", "waiting_for_host_ms") and not row.get("gpu_only_valid", False):
            return "—"  # the host did not stay ahead of the sleep: no GPU-only time
        return "—" if value is None else f"{scale * value:.1f}"
    size = "tiny" if row["height"] is None else f"{row['height']}²"
    return (f"| {row['model']} {size} | {row['config']} | {ms('wall_s', 1e3)} | {ms('wall_span_s', 1e3)} | "
            f"{ms('gpu_only_span_s', 1e3)} | {ms('waiting_for_host_ms')} | {ms('kernel_ms')} | "
            f"{row.get('kernel_count', '—')} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="flux", choices=("flux", "qwenimage"))
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--config", default="hookkit-fp8-mod+cache-fast+cuda-graphs", choices=sorted(bench.CONFIGS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--sleep-ms", type=float, default=3000.0,
                   help="the sleep queued before the GPU-only call: longer than the host's whole call")
    p.add_argument("--sleep-at", type=int, default=1,
                   help="the transformer call the sleep is queued before (after the prologue's and first step's syncs)")
    p.add_argument("--quick", action="store_true", help="CPU check: the tiny model, no GPU columns")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args()
    if args.quick:
        opts = bench.ModelOptions(name=args.model, steps=args.steps, device="cpu")
        args.runs, args.warmup = min(args.runs, 2), min(args.warmup, 1)
    else:
        bench.require_cuda("pipeline_split.py", "--quick checks the script on the CPU with the tiny model.")
        opts = bench.ModelOptions(name=args.model, full=True, steps=args.steps, height=args.size, width=args.size)
    config = bench.CONFIGS[args.config]
    reason = config.unavailable(bench.resolve_device(opts.device), bench.available_fields())
    if reason is not None:
        print(f"[pipeline_split] {config.name}: {reason}", file=sys.stderr)
        return 1
    with torch.no_grad():
        row = measure(config, opts, args.runs, args.warmup, args.sleep_ms, args.sleep_at)
    row["environment"] = bench.environment(bench.resolve_device(opts.device))
    row["argv"] = sys.argv[1:]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"pipeline_split_{args.model}_{config.name.replace('+', '_')}"
    bench.write_json(out / f"{name}.json", row)
    print("| model | config | wall ms | span ms | span GPU-only ms | GPU waits for host ms | kernels ms (whole call) "
          "| kernels |")
    print("|---|---|---|---|---|---|---|---|")
    print(markdown(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
