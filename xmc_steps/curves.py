"""Validation curves of the neural stages: kept through a kill, drawn as PNG beside the guard's numbers.

A learned stage evaluates on a fixed validation subset every ``eval_every`` steps and, when it
ends, compares itself with trivial baselines (its guard).  :class:`CurveLog` keeps the points in
a JSON file beside the training checkpoints, so a run that was killed and resumed still draws
its whole curve; :func:`plot_curve` draws the series against the optimisation step with the
baselines as horizontal lines and the final figure as a star.  Used by the X-Transformer matcher
and both ELIAS stages.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from . import io


class CurveLog:
    """``{step: {metric: value}}`` kept in ``path`` (JSON).  A point at or after the step a run
    starts from replaces the older run's (a resumed run does not keep points of steps it redoes)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.points: dict[int, dict[str, float]] = {}
        if self.path.exists():
            self.points = {int(k): dict(v) for k, v in io.read_json(self.path).items()}

    def add(self, step: int, values: Mapping[str, float], keys: tuple[str, ...] | None = None) -> None:
        """Record ``values`` (only ``keys`` of them, when given) at ``step``; nothing when none is there."""
        vals = {k: float(v) for k, v in values.items() if keys is None or k in keys}
        if not vals:
            return
        for old in [s for s in self.points if s >= step]:
            del self.points[old]
        self.points[int(step)] = vals
        self.path.parent.mkdir(parents=True, exist_ok=True)
        io.write_json(self.path, self.to_dict())

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {str(k): v for k, v in sorted(self.points.items())}


def plot_curve(path: str | os.PathLike, curve: Mapping[int, Mapping[str, float]], series: Mapping[str, str],
               baselines: Mapping[str, float], final: tuple[str, float] | None, title: str,
               ylabel: str = "valid metric") -> None:
    """PNG of ``curve``'s ``series`` (metric key -> legend label) over the steps, each baseline a
    horizontal line, ``final`` (legend label, value) a star at the last step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    steps = sorted(curve)
    for (key, label), style in zip(series.items(), ("o-", "s--", "^-.", "v:")):
        if steps:
            ax.plot(steps, [curve[s].get(key, np.nan) for s in steps], style, alpha=1.0 if style == "o-" else 0.6,
                    label=label)
    last = steps[-1] if steps else 1
    if final is not None:
        ax.plot([last], [final[1]], "k*", ms=12, label=f"{final[0]}: {final[1]:.3f}")
    for (name, v), style in zip(baselines.items(), (":", "-.", "--", ":")):
        ax.axhline(v, linestyle=style, color="gray", label=f"{name}: {v:.3f}")
    ax.set_xlabel("optimisation step")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    with io.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
