"""Import diffusers' models and pipelines without the chatter that hookkit itself would trigger.

On a CPU machine with torchao installed, the first import of a diffusers model or pipeline prints about seven
lines nobody can act on: torchao's "Failed to load ..._C_mxfp8...so" (its CUDA kernels), two torch pytree
deprecation warnings from torchao's enums, diffusers' "Unable to import `torchao` Tensor objects" and
transformers' "requires torchvision" fallbacks. hookkit's own code paths that import them (`hookkit.tools.zoo`,
`hookkit.tools.trained`, the CLI's loaders, the adapter derivation) do so inside `quiet_imports()` (zoo's
builders run inside it as a whole: their diffusers imports are lazy, at the first build); `import hookkit` imports none of
them (hookkit's torchao imports are lazy, at `Quantize`'s attach). What a user imports themselves is left alone,
and every logger level and warning filter is put back as it was when the block ends.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

#: stdlib loggers whose import-time warnings are silenced (torchao's kernels, torch's pytree deprecation)
LOGGERS: tuple[str, ...] = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Silence import-time warnings of torchao, torch, diffusers and transformers inside the block.

    Errors still show (level ERROR and above); the levels and filters before the block come back after it.
    """
    saved = {name: logging.getLogger(name).level for name in LOGGERS}
    libraries = []
    for module in ("diffusers.utils.logging", "transformers.utils.logging"):
        try:
            lib = __import__(module, fromlist=["get_verbosity"])
        except ImportError:  # transformers is optional
            continue
        libraries.append((lib, lib.get_verbosity()))
    try:
        for name in LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        for lib, _ in libraries:
            lib.set_verbosity(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.filterwarnings("ignore", category=UserWarning, module="torchao")
            yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
        for lib, level in libraries:
            lib.set_verbosity(level)
