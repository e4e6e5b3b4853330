"""CPU cost of hookkit's hook chain: a no-op hook must add at most 10 µs per call.

    python benchmarks/hook_overhead.py [--calls 20000] [--repeats 7]

Times `module(x)` on a tiny module (so the module's own work is negligible) with 0, 1, 4 and 16 no-op
hooks, and with one replacing hook; reports the median over repeats of the per-call time and the added
cost per hook. Also the same with PyTorch's own `register_forward_pre_hook` for reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hookkit.core.registry import HookRegistry, ModelHook


class Passthrough(ModelHook):
    replaces_forward = True


def per_call_us(module: torch.nn.Module, x: torch.Tensor, calls: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            module(x)
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    x = torch.zeros(1)
    module = torch.nn.Identity()
    for _ in range(200):
        module(x)
    base = per_call_us(module, x, args.calls, args.repeats)
    rows = [("no hooks", 0, base)]
    registry = HookRegistry.of(module)
    count = 0
    for target in (1, 4, 16):
        while count < target:
            registry.register(f"noop{count}", ModelHook())
            count += 1
        rows.append((f"{target} no-op hooks", target, per_call_us(module, x, args.calls, args.repeats)))
    for i in range(count):
        registry.remove(f"noop{i}")
    registry = HookRegistry.of(module)
    registry.register("replace", Passthrough())
    rows.append(("1 replacing hook (new_forward)", 1, per_call_us(module, x, args.calls, args.repeats)))
    registry.remove("replace")
    torch_handle = module.register_forward_pre_hook(lambda m, a: None)
    rows.append(("torch register_forward_pre_hook (reference)", 1, per_call_us(module, x, args.calls, args.repeats)))
    torch_handle.remove()

    print(f"torch {torch.__version__}; median of {args.repeats} x {args.calls} calls of nn.Identity\n")
    print("| configuration | µs per call | added µs per hook |")
    print("|---|---|---|")
    for name, n, us in rows:
        added = (us - base) / n if n else 0.0
        print(f"| {name} | {us:.2f} | {added:.2f} |")
    print(json.dumps({name: round(us, 3) for name, _, us in rows}))


if __name__ == "__main__":
    main()
