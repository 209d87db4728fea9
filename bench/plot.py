"""Figures drawn from a results directory, saved as PNG and SVG beside its records."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from bench.results import Run, load_run
from bench.sizes import format_size

FORMATS = ("png", "svg")
#: one look per transport, the same in every figure
STYLE = {
    "local": {"color": "#444444", "marker": "s", "linestyle": "--"},
    "grpc_tcp": {"color": "#d62728", "marker": "o"},
    "grpc_rdma": {"color": "#ff7f0e", "marker": "v"},
    "grpc_rdma:direct": {"color": "#bcbd22", "marker": "<"},
    "rdma_cp": {"color": "#2ca02c", "marker": "^"},
    "zerocopy": {"color": "#1f77b4", "marker": "D"},
    # reference lines: the fabric library's own limit, and a copy within one process
    "ucx_perftest": {"color": "#9467bd", "linestyle": ":", "marker": "x"},
    "memcpy": {"color": "#8c564b", "linestyle": "-.", "marker": "+"},
}
LABELS = {
    "local": "Local (no transfer)",
    "grpc_tcp": "gRPC.TCP",
    "grpc_rdma": "gRPC.RDMA (buffered)",
    "grpc_rdma:direct": "gRPC.RDMA direct (0-copy)",
    "rdma_cp": "RDMA.cp",
    "zerocopy": "RDMA.zerocp",
    "ucx_perftest": "ucx_perftest put_bw (library limit)",
    "memcpy": "memcpy in one process",
}


class PlotError(ValueError):
    """Nothing to draw, or an experiment this command cannot draw."""


def plot_run(path: Path) -> list[Path]:
    """Draw every figure the run's experiment has; returns the files written."""
    run = load_run(path)
    if run.records.empty:
        raise PlotError(f"{path}: the run has no records to draw")
    if run.experiment == "micro":
        return plot_micro(run)
    raise PlotError(f"{path}: no figures are defined for experiment '{run.experiment}'")


def _size_axis(ax, sizes) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(sizes))
    if len(ticks) > 12:
        ticks = ticks[:: -(-len(ticks) // 12)]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format_size(int(v))))
    ax.set_xlabel("tensor size (binary units)")


def _subtitle(run: Run) -> str:
    host = run.meta.get("host", "?")
    cpu = run.meta.get("cpu", "?")
    when = (run.meta.get("start_time") or "")[:16].replace("T", " ")
    fabric = run.meta.get("settings", {}).get("fabric_transport")
    return f"{host} · {cpu} · {when} UTC" + (f" · fabric transport: {fabric}" if fabric else "")


def _save(fig, run: Run, stem: str) -> list[Path]:
    written = []
    for fmt in FORMATS:
        out = run.path / f"{stem}.{fmt}"
        fig.savefig(out, dpi=150, bbox_inches="tight")
        written.append(out)
    plt.close(fig)
    return written


def _transports_in_order(records) -> list[str]:
    present = list(dict.fromkeys(records["transport"]))
    return sorted(present, key=lambda t: (list(STYLE).index(t) if t in STYLE else len(STYLE), t))


def plot_micro(run: Run) -> list[Path]:
    """Figure 8 of the paper (time per transfer against size) and throughput against size."""
    records = run.records.sort_values("size_bytes")
    written = []

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for name in _transports_in_order(records):
        rows = records[records["transport"] == name]
        style = STYLE.get(name, {})
        ax.plot(rows["size_bytes"], rows["p50_us"], label=LABELS.get(name, name), **style)
        ax.fill_between(rows["size_bytes"], rows["p50_us"], rows["p99_us"], color=style.get("color"), alpha=0.12,
                        linewidth=0)
    ax.set_yscale("log")
    _size_axis(ax, records["size_bytes"])
    ax.set_ylabel("time per transfer, median (µs); band up to p99")
    ax.set_title("Send/receive micro-benchmark: time per transfer\n" + _subtitle(run), fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    written += _save(fig, run, "micro_time")

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for name in _transports_in_order(records):
        rows = records[records["transport"] == name]
        ax.plot(rows["size_bytes"], rows["throughput_MBps"], label=LABELS.get(name, name), **STYLE.get(name, {}))
    ax.set_yscale("log")
    _size_axis(ax, records["size_bytes"])
    ax.set_ylabel("throughput (MB/s, MB = 2^20 bytes)")
    ax.set_title("Send/receive micro-benchmark: throughput\n" + _subtitle(run), fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    written += _save(fig, run, "micro_throughput")
    return written
