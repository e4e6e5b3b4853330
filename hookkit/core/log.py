"""Logging: loguru, silent by default.

hookkit logs when it attaches and detaches hooks, never per forward call. Turn it on with
`hookkit.set_verbosity("INFO")` or the environment variable `HOOKKIT_LOG=INFO` (read at import;
another value is ignored with a warning).
"""

from __future__ import annotations

import os
import sys
import warnings

from loguru import logger

logger.disable("hookkit")
_sink_id: int | None = None
#: hookkit's stand-in for loguru's default handler (id 0), see `_take_over_default_handler`
_default_id: int | None = None
_LEVELS = ("TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL")


def set_verbosity(level: str | None) -> None:
    """Log hookkit's attach/detach messages to stderr at `level` ("DEBUG", "INFO", ...); `None` silences it."""
    global _sink_id
    from hookkit.errors import field_error

    if _sink_id is not None:
        logger.remove(_sink_id)
        _sink_id = None
    if level is None:
        logger.disable("hookkit")
        return
    if not isinstance(level, str) or level.upper() not in _LEVELS:
        raise field_error("set_verbosity", "level", level, f"one of {_LEVELS} or None")
    _take_over_default_handler()
    logger.enable("hookkit")
    _sink_id = logger.add(
        sys.stderr,
        level=level.upper(),
        filter=lambda record: record["name"].startswith("hookkit"),
        format="<green>hookkit</green> | <level>{level: <7}</level> | {message}",
    )


def _take_over_default_handler() -> None:
    """loguru's default handler (stderr, every level) would print each enabled hookkit message a second time
    and ignore `level`. If it is still installed, replace it by the same handler minus hookkit's records;
    handlers an application added itself are left alone."""
    global _default_id
    if _default_id is not None:
        return
    try:
        logger.remove(0)
    except ValueError:  # already removed: the application configures loguru itself
        return
    _default_id = logger.add(sys.stderr, level="DEBUG", filter=lambda record: not record["name"].startswith("hookkit"))


def verbosity_from_environment() -> None:
    """Apply `HOOKKIT_LOG` (unset or empty: silent). A value `set_verbosity` does not take is ignored with a
    warning naming the variable and what it takes, rather than raised: it is read at `import hookkit`, and a typo
    in a logging switch should not make every program that imports hookkit fail."""
    value = os.environ.get("HOOKKIT_LOG", "").strip()
    if not value:
        return
    if value.upper() not in _LEVELS:
        warnings.warn(f"HOOKKIT_LOG={value!r}: expected one of {', '.join(_LEVELS)} (any case), or unset; ignored, "
                      "hookkit's log stays off. Set e.g. HOOKKIT_LOG=INFO, or unset it.", UserWarning, stacklevel=2)
        return
    set_verbosity(value)


verbosity_from_environment()
