"""matplotlib, an optional dependency (`pip install hookkit[plot]`), imported in one place."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

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


def save_png(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    """Lay out `fig`, write it as a PNG at `path` (its folder made), close it; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=dpi)
    plt.close(fig)
    return out
