"""The demo's output: one line per step, a summary table (rich), a PNG plot (matplotlib, no display needed)."""

from __future__ import annotations

from typing import Any

__all__ = ["step_line", "summary_table", "plot"]


def _mb(b: Any) -> str:
    return f"{b / 1e6:.2f} MB" if isinstance(b, (int, float)) else "-"


def _per_engine(by_engine: dict[str, Any]) -> str:
    return ", ".join(f"{n} {_mb(b)}" for n, b in sorted(by_engine.items()) if b is not None)


def step_line(s: dict[str, Any]) -> str:
    """One step as a line of rich markup."""
    from rich.markup import escape

    exact = s["exact"]
    ok = "[green]exact[/green]" if exact and all(exact.values()) and not s["sync_errors"] else "[red]NOT EXACT[/red]"
    per = escape(_per_engine(s["bytes_per_engine"]) or "-")
    wire = s.get("wire_bytes_per_engine") or {}
    if any(wire.get(n) != b for n, b in s["bytes_per_engine"].items()):  # delta sync: fewer bytes read than applied
        per += escape(f"; read {_per_engine(wire)}")
    extra = ""
    if "killed" in s:
        extra += f"  [yellow]killed {s['killed']} after its rollouts; restarting[/yellow]"
    if s["dropped"]:
        extra += f"  dropped {escape(', '.join(s['dropped']))}"
    if s["rejoined"]:
        extra += f"  [cyan]{', '.join(s['rejoined'])} rejoined, exact[/cyan]"
    return (f"step {s['step']:3d}  reward {s['reward']:.3f}  loss {s['loss']:+.4f}  sync {s['sync_s']:.2f} s  "
            f"bytes/engine ({per})  live engines {s['live_engines']}  {ok} vs fresh load "
            f"(sha {s['weights_sha256']}){extra}")


def summary_table(steps: list[dict[str, Any]], report: dict[str, Any]):
    from rich.table import Table

    t = Table(title="shardsync demo: summary")
    t.add_column("what")
    t.add_column("value", justify="right")
    syncs = [s["sync_s"] for s in steps]
    t.add_row("steps", str(len(steps)))
    if steps:
        t.add_row("mean reward, first step -> last step", f"{report['reward_first']:.3f} -> {report['reward_last']:.3f}")
        t.add_row("sync seconds (median / max)", f"{sorted(syncs)[len(syncs) // 2]:.2f} / {max(syncs):.2f}")
        t.add_row("model bytes (full)", _mb(steps[0]["model_bytes"]))
        read = sorted(b for s in steps[1:] for b in (s.get("wire_bytes_per_engine") or {}).values() if b is not None)
        if read:
            t.add_row("bytes read per engine per sync after the first (median)", _mb(read[len(read) // 2]))
    t.add_row("every engine exact after every sync", "yes" if report["all_exact"] else "NO")
    t.add_row("engines killed", ", ".join(f"{k['engine']} at step {k['step']}" for k in report["killed"]) or "-")
    t.add_row("rejoined (exact)", ", ".join(f"{k['engine']} at step {k['step']}" for k in report["rejoined"]) or "-")
    t.add_row("wall seconds", f"{report['seconds']:.0f}")
    return t


def plot(steps: list[dict[str, Any]], path: str, *, kill_at: int | None = None, engines: int = 2) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["step"] for s in steps]
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    a.plot(xs, [s["reward"] for s in steps], marker="o", color="tab:green")
    a.set_ylabel("mean reward")
    a.set_ylim(0, 1.05)
    a.set_title(f"shardsync demo: GRPO; weights synced into {engines} vLLM engines after every step", fontsize=10)
    b.bar(xs, [s["sync_s"] for s in steps], color=["tab:red" if s.get("killed") else "tab:blue" for s in steps])
    b.set_ylabel("sync seconds")
    b.set_xlabel("step")
    for ax in (a, b):
        if kill_at is not None:
            ax.axvline(kill_at, color="tab:red", linestyle="--", linewidth=1)
    from matplotlib.ticker import MaxNLocator

    b.xaxis.set_major_locator(MaxNLocator(integer=True))
    if kill_at is not None:
        a.annotate(" engine killed", (kill_at, 0.05), color="tab:red", fontsize=8)
        b.annotate(" this sync drops the dead engine", (kill_at + 0.45, max(s["sync_s"] for s in steps) * 0.9),
                   color="tab:red", fontsize=8)
    for s in steps:
        for n in s["rejoined"]:
            a.axvline(s["step"], color="tab:cyan", linestyle=":", linewidth=1)
            a.annotate(f" {n} rejoined, exact", (s["step"], 0.15), color="tab:cyan", fontsize=8)
    bad = [s["step"] for s in steps if not (s["exact"] and all(s["exact"].values()))]
    if bad:
        a.plot(bad, [0.02] * len(bad), "rx", label="not exact")
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
