"""matplotlib, an optional dependency (`pip install hookkit[plot]`), imported in one place."""

from __future__ import annotations

from types import ModuleType

from hookkit.errors import UnsupportedError


def pyplot(user: str, alternative: str = "") -> ModuleType:
    """`matplotlib.pyplot` on the file-only Agg backend, or an UnsupportedError naming `user`, how to install
    matplotlib and `alternative` (e.g. ", or skip the plot (--no-plot)")."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UnsupportedError(
            f"{user} needs matplotlib, which is not installed. Install it with `pip install hookkit[plot]` "
            f"(or `pip install matplotlib`){alternative}."
        ) from None
    return plt
