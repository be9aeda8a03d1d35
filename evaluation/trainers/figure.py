"""The figure of a trainer evaluation: one row per run (its family and fault), the steps on x,
the fault's step as a black bar and the window it may be caught in shaded, every alarm as a
dot coloured by its kind (notices as small grey ticks), a run that raised marked in red; on
the right, the run's score (caught or missed, its alarm incidents, the cause when it is not
the expected one, how far the fault moved the loss in noise units (``effect_z``, where the
run has it), its steps without a loss).
A healthy row with a dot is a false alarm; a faulted row without a dot in its window a miss.
"""

from __future__ import annotations

from pathlib import Path


def draw(runs: list[dict], path: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the held-out families last, marked: a reader tells the two scores apart at a glance
    rows = sorted(runs, key=lambda r: (bool(r.get("held_out")), r["family"], r["fault"] or "",
                                       r["seed"]))
    kinds = sorted({a["kind"] for r in rows for a in r.get("alarms", [])})
    cmap = plt.get_cmap("tab10" if len(kinds) <= 10 else "tab20")
    colour = {k: cmap(i % cmap.N) for i, k in enumerate(kinds)}
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.19 * len(rows)), layout="constrained")
    labels = []
    for y, r in enumerate(rows):
        labels.append(("[held out] " if r.get("held_out") else "")
                      + f"{r['family']}  {r['fault'] or 'healthy'}"
                      + (f" s{r['seed']}" if not r["fault"] else ""))
        steps = r.get("trained_steps") or r["steps"]
        ax.plot([0, steps], [y, y], color="0.85", lw=0.8, zorder=1)
        if "error" in r:
            ax.text(2, y, "ERROR " + r["error"][:70], color="red", fontsize=6, va="center")
            continue
        if r["fault"]:
            k = r["fault_step"]
            ax.fill_betweenx([y - 0.4, y + 0.4], k, k + max(r["max_delay"], 1),
                             color="0.75", zorder=1)
            ax.plot([k, k], [y - 0.42, y + 0.42], color="black", lw=1.4, zorder=2)
        for n in r.get("notices", []):
            ax.plot([n["step"]], [y], marker="|", color="0.55", ms=4, zorder=2)
        for a in r.get("alarms", []):
            ax.scatter([a["step"]], [y], color=colour[a["kind"]], s=18, zorder=3,
                       edgecolors="black", linewidths=0.3)
        mark = ""
        if r["fault"]:
            mark = ("caught" if r["caught"] else "MISSED") + f", {r['alarm_incidents']} inc"
            if r["caught"]:
                mark += ", cause ok" if r["right_cause"] else f", cause {r['cause']}"
            if r.get("effect_z") is not None:  # runs scored before effect_z have none
                mark += f", z {r['effect_z']:.1f}"
        elif r["n_alarms"]:
            mark = f"{r['n_alarms']} false"
        if r["null_loss_steps"]:
            mark += (", " if mark else "") + f"{r['null_loss_steps']} null loss"
        ax.text(1.005, y, mark, transform=ax.get_yaxis_transform(), fontsize=6, va="center",
                color="black" if mark.startswith("caught") or not mark else "firebrick")
    ax.set_yticks(range(len(rows)), labels, fontsize=6)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("optimizer step")
    handles = [plt.Line2D([], [], marker="o", ls="", color=colour[k], label=k) for k in kinds]
    handles += [plt.Line2D([], [], color="black", lw=1.4, label="fault's step (grey: its delay)"),
                plt.Line2D([], [], marker="|", ls="", color="0.55", label="notice")]
    ax.legend(handles=handles, fontsize=6, loc="lower left", bbox_to_anchor=(0.0, 1.0),
              ncol=6, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def draw_harm(runs: list[dict], path: str | Path, title: str = "", visible_z: float = 6.0) -> None:
    """What each planted fault did, against whether it was caught: x, how far it moved the
    loss at its step (``effect_z``, noise units; a non-finite loss at the right edge); y, its
    lasting harm (``harm_end``: the mean loss of the run's last steps over its healthy twin's,
    minus 1), in units of the family's seed-to-seed gap (``seed_gap_end``; the top edge: no
    finite loss left). Caught faults as dots, missed ones as red crosses named; squares for
    the held-out families. A miss low on the left moved nothing and cost nothing."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_edge, y_lo, y_hi = 40.0, 1e-3, 1e2
    fig, ax = plt.subplots(figsize=(12, 6), layout="constrained")
    named: list[str] = []
    for r in runs:
        if not r.get("fault") or "error" in r or "harm_end" not in r:
            continue
        z = r.get("effect_z")
        x = x_edge if z is None or not math.isfinite(z) else min(max(z, -2.0), x_edge)
        gap, h = r.get("seed_gap_end"), r.get("harm_end")
        if not gap:
            continue
        y = y_hi if h is None else min(max(abs(h) / gap, y_lo), y_hi)
        marker = "s" if r.get("held_out") else "o"
        if r.get("caught"):
            ax.scatter(x, y, marker=marker, s=22, color="tab:blue", alpha=0.55, linewidths=0)
        else:
            ax.scatter(x, y, marker="x" if marker == "o" else "D", s=40, color="tab:red")
            named.append(f"{len(named) + 1}  {r['family']}  {r['fault']}"
                         f"{'  (held out)' if r.get('held_out') else ''}")
            ax.annotate(str(len(named)), (x, y), fontsize=7, color="tab:red",
                        xytext=(4, 3 if len(named) % 2 else -9), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_ylim(y_lo * 0.7, y_hi * 1.5)
    ax.set_xlim(-2.5, x_edge + 2)
    ax.axvline(visible_z, color="grey", ls="--", lw=0.8)
    ax.text(visible_z, y_hi, f" visible: loss moved >= {visible_z:g} units", fontsize=7,
            va="top", color="grey")
    ax.axhline(1.0, color="grey", ls=":", lw=0.8)
    ax.text(-2.3, 1.05, "harm = the gap between two healthy seeds", fontsize=7, color="grey")
    ax.set_xlabel(f"effect_z: how far the fault moved the loss at its step (noise units; "
                  f"{x_edge:g} = beyond, or not finite)")
    ax.set_ylabel("|harm_end| / seed gap (lasting effect on the loss; top: no finite loss)")
    handles = [plt.Line2D([], [], ls="", marker="o", color="tab:blue", label="caught"),
               plt.Line2D([], [], ls="", marker="x", color="tab:red", label="missed (tuning)"),
               plt.Line2D([], [], ls="", marker="D", color="tab:red", label="missed (held out)"),
               plt.Line2D([], [], ls="", marker="s", color="tab:blue", label="held out, caught")]
    ax.legend(handles=handles, loc="lower right", fontsize=8)
    if named:
        ax.text(1.02, 1.0, "missed:\n" + "\n".join(named), transform=ax.transAxes, fontsize=7,
                va="top", color="tab:red", family="monospace")
    ax.set_title(title or "planted faults: what they moved and what they cost", fontsize=10)
    fig.savefig(path, dpi=130)
    plt.close(fig)
