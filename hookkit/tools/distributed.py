"""`hookkit generate/bench --parallel ulysses=2` under torchrun: process group, rank 0 output, decision checks.

    torchrun --nproc_per_node 2 -m hookkit generate flux --full --parallel ulysses=2 --cache --cache-mask fast
    torchrun --nproc_per_node 2 -m hookkit bench --full --parallel ulysses=2 --configs eager,hookkit-cache-fast

Every rank builds the same pipeline from the same seed and runs the same call; diffusers' context parallelism
shards the sequence. Rank 0 prints and writes files; the others stay silent. After the run every rank's DBCache
decisions (cached and computed steps per branch) are gathered and compared: ranks that disagree would have
deadlocked or produced garbage, so a mismatch is an error naming the ranks and steps.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from hookkit.core.parallel import gather_objects
from hookkit.errors import HookError, SpecError, UnsupportedError
from hookkit.techniques.parallel.spec import ContextParallel

_KEYS = {"ulysses": int, "ring": int, "ulysses_anything": bool, "ring_anything": bool, "attention_backend": str}


def parse_parallel(text: str) -> ContextParallel:
    """`ulysses=2`, `ring=2,attention_backend=_native_cudnn`, `ulysses=2,ulysses_anything=true` -> ContextParallel."""
    kwargs: dict[str, Any] = {}
    for item in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in _KEYS:
            raise SpecError(f"--parallel {text!r}: expected comma-separated key=value with keys {sorted(_KEYS)}, got "
                            f"{item!r}. Example: --parallel ulysses=2 (or ring=2,attention_backend=_native_cudnn).")
        kind = _KEYS[key]
        if kind is int:
            try:
                kwargs[key] = int(value)
            except ValueError:
                raise SpecError(f"--parallel {key}={value}: expected an integer, got {value!r}.") from None
        elif kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise SpecError(f"--parallel {key}={value}: expected true or false, got {value!r}.")
            kwargs[key] = value.lower() in ("true", "1")
        else:
            kwargs[key] = value
    return ContextParallel(**kwargs)


def init_distributed(device: str | None) -> str:
    """Join torchrun's process group (NCCL on CUDA, gloo on the CPU) and return this rank's device.

    Needs torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); one GPU per rank.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UnsupportedError("--parallel: expected to run under torchrun (RANK and WORLD_SIZE set), got neither. "
                               "Run `torchrun --nproc_per_node 2 -m hookkit ... --parallel ulysses=2`.")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # torchrun sets them; a hand-set one may be anything
        value = os.environ.get(name)
        if value is not None and not value.strip().isdigit():
            raise SpecError(f"--parallel: expected the environment variable {name} to be an int >= 0 (torchrun "
                            f"sets it), got {value!r}. Run under torchrun, or fix {name}.")
    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    use_cuda = torch.cuda.is_available() and (device is None or device.startswith("cuda"))
    if use_cuda:
        if local >= torch.cuda.device_count():
            raise UnsupportedError(f"--parallel: expected one GPU per rank, got local rank {local} and "
                                   f"{torch.cuda.device_count()} visible GPUs. Lower --nproc_per_node.")
        torch.cuda.set_device(local)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    return f"cuda:{local}" if use_cuda else "cpu"


def is_main() -> bool:
    """Rank 0, or no process group at all."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


@contextlib.contextmanager
def main_rank_output() -> Iterator[None]:
    """Ranks other than 0 print nothing to stdout inside."""
    if is_main():
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def cache_decisions(features: dict[str, Any]) -> dict[str, Any] | None:
    """Cached and computed steps per branch from a summary's feature data (`{name: data}`), or None without DBCache."""
    from hookkit.techniques.cache.hooks import NAME

    data = features.get(NAME)
    if data is None:
        return None
    return {str(b): {"cached": list(v["cached"]), "computed": list(v["computed"])}
            for b, v in data["branches"].items()}


def check_same_decisions(features: dict[str, Any], what: str) -> int:
    """Gather every rank's DBCache decisions and compare them with rank 0's; returns the number of ranks.

    Raises `HookError` naming the first rank that differs (every rank raises alike: they all see the gather).
    """
    decisions = gather_objects(cache_decisions(features))
    for rank, theirs in enumerate(decisions[1:], 1):
        if theirs != decisions[0]:
            raise HookError(f"{what}: expected the same DBCache decisions on every rank, got rank 0 {decisions[0]} and "
                            f"rank {rank} {theirs}. The ranks' inputs differ (seeds, prompts) or a cache decision is "
                            "rank-dependent; report it with this message.")
    return len(decisions)


def parallelised(config: Any, cp: ContextParallel) -> Any:
    """A bench configuration whose fresh pipeline is first sharded with diffusers' own API, then set up as usual
    (hookkit rides on it: its DBCache decisions become global)."""
    setup = config.setup

    def run(ctx: Any) -> None:
        transformer = ctx.pipe.transformer
        if cp.attention_backend is not None:
            transformer.set_attention_backend(cp.attention_backend)
        transformer.enable_parallelism(config=cp.diffusers_config())
        setup(ctx)

    return attrs.evolve(config, setup=run, description=f"{config.description}; context parallel "
                                                       f"ulysses {cp.ulysses} x ring {cp.ring}")


def run_matrix(configs: Sequence[Any], opts: Any, runs: int, warmup: int, out_dir: Path | None, cp: ContextParallel,
               log: Callable[[str], None]) -> list[dict[str, Any]]:
    """`bench.run_matrix` for torchrun: every rank measures every configuration in this process (a child process
    would leave the process group); rows get each rank's peak memory and whether all ranks decided alike."""
    from hookkit.tools import bench

    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if out_dir is None or not is_main():  # only rank 0 keeps outputs
            out_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hookkit-bench-cp-")))
        out_dir.mkdir(parents=True, exist_ok=True)
        for i, config in enumerate(configs, 1):
            if is_main():
                log(f"[{i}/{len(configs)}] {config.name}: {config.description}")
            if config.kind == "peer":
                rows.append(bench._empty_row(config, "skipped", "peers bring their own parallelism: "
                                                                "benchmarks/context_parallel.py runs cache-dit's"))
                continue
            row = bench.measure(parallelised(config, cp), opts, runs, warmup, out_dir)
            statuses = gather_objects((row["status"], row["peak_memory_gb"]))
            row["peak_memory_gb_per_rank"] = [s[1] for s in statuses]
            if row["status"] == "ok" and all(s[0] == "ok" for s in statuses):
                try:
                    row["ranks"] = check_same_decisions(row["features"], f"bench {config.name}")
                    row["ranks_agree"] = True
                except HookError as exc:
                    row.update(status="failed", note=str(exc)[:300], ranks_agree=False)
            rows.append(row)
            if is_main():
                log(f"[{i}/{len(configs)}] {config.name}: {bench._status_line(row)}")
        if is_main():
            bench._compare(rows, out_dir, peak=None if opts.full else 1.0)
    return rows
