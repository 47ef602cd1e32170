"""Drawing a pipeline schedule: :func:`plot_schedule`, a matplotlib timeline of a ScheduleTable."""

from __future__ import annotations

from typing import Any

from jaxops._errors import ArgumentTypeError

from ._schedule import FORWARD, IDLE, ScheduleTable, schedule_table

__all__ = ["plot_schedule"]


def plot_schedule(
    table: ScheduleTable | str,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    virtual_stages: int = 1,
    *,
    path: Any = None,
):
    """Draws a schedule as a timeline: one row per device, forward / backward / idle per tick.

    Needs matplotlib (``pip install 'jaxops[examples]'``). The title carries the bubble fraction.

    Args:
      table: a :class:`ScheduleTable`, or a schedule name followed by the counts of
        :func:`schedule_table`.
      num_stages: with a schedule name, P.
      num_microbatches: with a schedule name, M.
      virtual_stages: with a schedule name, V.
      path: where to write the PNG (None: do not write).

    Returns:
      The matplotlib Figure.

    Example:
      >>> import tempfile, os
      >>> from jaxops.parallel.pipeline import plot_schedule
      >>> out = os.path.join(tempfile.mkdtemp(), "1f1b.png")
      >>> fig = plot_schedule("1f1b", 4, 8, path=out)
      >>> fig.axes[0].get_title()
      '1f1b: P=4 M=8 V=1 -- 22 ticks, bubble 27.3% (theory 27.3%)'
      >>> open(out, "rb").read(4) == bytes([0x89]) + b"PNG"
      True
    """
    if isinstance(table, str):
        if num_stages is None or num_microbatches is None:
            raise ArgumentTypeError(
                "jaxops.parallel.pipeline.plot_schedule: with a schedule name, give num_stages "
                "and num_microbatches"
            )
        table = schedule_table(table, num_stages, num_microbatches, virtual_stages)
    if not isinstance(table, ScheduleTable):
        raise ArgumentTypeError(
            "jaxops.parallel.pipeline.plot_schedule: table must be a ScheduleTable or a "
            f"schedule name, got {type(table).__name__}"
        )
    import matplotlib  # a Figure without pyplot: no backend switch, nothing shown
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    p, t = table.num_stages, table.num_ticks
    fig = Figure(figsize=(min(2 + 0.28 * t, 40), 1 + 0.45 * p), dpi=100)
    ax = fig.add_subplot()
    v = max(table.virtual_stages, 1)
    forward = matplotlib.colormaps["Blues"]
    backward = matplotlib.colormaps["Oranges"]
    for d in range(p):
        for tick in range(t):
            k = int(table.kind[tick, d])
            if k == IDLE:
                color = "#eeeeee"
            else:
                shade = 0.45 + 0.4 * int(table.chunk[tick, d]) / max(v - 1, 1)
                color = (forward if k == FORWARD else backward)(shade)
            ax.add_patch(Rectangle((tick, d), 1, 1, color=color, lw=0))
            if k != IDLE and t <= 80:
                ax.text(
                    tick + 0.5,
                    d + 0.5,
                    str(table.microbatch[tick, d]),
                    ha="center",
                    va="center",
                    fontsize=7,
                )
    ax.set_xlim(0, t)
    ax.set_ylim(p, 0)
    ax.set_yticks([d + 0.5 for d in range(p)], [f"device {d}" for d in range(p)])
    ax.set_xlabel("tick (one chunk's forward or backward)")
    ax.set_title(
        f"{table.schedule}: P={p} M={table.num_microbatches} V={table.virtual_stages} -- "
        f"{t} ticks, bubble {100 * table.bubble_fraction:.1f}% "
        f"(theory {100 * table.theoretical_bubble:.1f}%)"
    )
    ax.legend(
        handles=[
            Patch(color=forward(0.6), label="forward"),
            Patch(color=backward(0.6), label="backward"),
            Patch(color="#eeeeee", label="idle"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, format="png")
    return fig
