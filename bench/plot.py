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
    "zerocopy:no_analysis": {"color": "#9ecae1", "marker": "d"},
    # reference lines: the fabric library's own limit, and a copy within one process
    "ucx_perftest": {"color": "#9467bd", "linestyle": ":", "marker": "x"},
    "ucx_perftest_lat": {"color": "#e377c2", "linestyle": ":", "marker": "1"},
    "ib_write_bw": {"color": "#9467bd", "linestyle": ":", "marker": "x"},
    "ib_write_lat": {"color": "#e377c2", "linestyle": ":", "marker": "1"},
    "memcpy": {"color": "#8c564b", "linestyle": "-.", "marker": "+"},
    "tf_grpc": {"color": "#7f7f7f", "marker": "*", "linestyle": "-."},
}
LABELS = {
    "local": "Local (no transfer)",
    "grpc_tcp": "gRPC.TCP",
    "grpc_rdma": "gRPC.RDMA (buffered)",
    "grpc_rdma:direct": "gRPC.RDMA direct (0-copy)",
    "rdma_cp": "RDMA.cp",
    "zerocopy": "RDMA.zerocp",
    "zerocopy:no_analysis": "RDMA.zerocp, analysis off (dynamic allocation)",
    "ucx_perftest": "ucx_perftest put_bw (library limit)",
    "ucx_perftest_lat": "ucx_perftest put_lat (half a round trip: latency floor)",
    "ib_write_bw": "ib_write_bw (the NIC's write bandwidth)",
    "ib_write_lat": "ib_write_lat (the NIC's write latency)",
    "memcpy": "memcpy in one process",
    "tf_grpc": "TensorFlow PS over gRPC (today)",
}


class PlotError(ValueError):
    """Nothing to draw, or an experiment this command cannot draw."""


def plot_run(path: Path, out_dir: Path | None = None) -> list[Path]:
    """Draw every figure the run's experiment has, into ``out_dir`` (default: the run's directory);
    returns the files written."""
    run = load_run(path)
    if out_dir is not None:
        run.meta["figure_dir"] = Path(out_dir)
    if run.records.empty:
        raise PlotError(f"{path}: the run has no records to draw")
    if run.experiment == "micro":
        return plot_micro(run)
    if run.experiment == "model":
        return plot_model(run)
    if run.experiment == "scale":
        return plot_scale(run)
    if run.experiment == "converge":
        return plot_converge(run)
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
    settings = run.meta.get("settings", {})
    backend, links = settings.get("fabric", "ucx"), settings.get("fabric_transport")  # runs before --fabric: ucx
    return f"{host} · {cpu} · {when} UTC" + (f" · fabric: {backend} ({links})" if links else "")


def _save(fig, run: Run, stem: str) -> list[Path]:
    written = []
    for fmt in FORMATS:
        out = Path(run.meta.get("figure_dir") or run.path) / f"{stem}.{fmt}"
        fig.savefig(out, dpi=150, bbox_inches="tight")
        written.append(out)
    plt.close(fig)
    return written


def _compute_note(records) -> str:
    """How the workers computed, when not for real: replayed records are never to be mistaken for real ones."""
    modes = sorted(set(records["compute"].dropna())) if "compute" in records else []
    notes = {"replay": "compute REPLAYED (workers wait the time measured here)",
             "paper": "compute REPLAYED at the paper's P100 times (Table 2)"}
    return " · ".join(notes[m] for m in modes if m in notes)


def _launch_note(records) -> str:
    parts = []
    if "launcher" in records and records["launcher"].notna().any():
        parts.append("launcher " + ", ".join(sorted(set(records["launcher"].dropna().astype(str)))))
    if "link_rate" in records and records["link_rate"].notna().any():
        parts.append("links " + ", ".join(sorted(set(records["link_rate"].dropna().astype(str)))))
    return " · ".join(parts)


def _transports_in_order(records) -> list[str]:
    present = list(dict.fromkeys(records["transport"]))
    return sorted(present, key=lambda t: (list(STYLE).index(t) if t in STYLE else len(STYLE), t))


#: on the time figure: lines without a per-transfer median, drawn from their mean time per transfer instead
TIME_FROM_MEAN = {"ucx_perftest": "ucx_perftest put_bw: size / bandwidth (pipelined puts, not a latency)",
                  "ib_write_bw": "ib_write_bw: size / bandwidth (pipelined writes, not a latency)"}


def micro_time_lines(records) -> list[tuple[str, str, object, object, object]]:
    """What the time figure draws: ``(transport, label, sizes, time, p99)`` per line, in legend order.

    The time is the median (``p50_us``). ``ucx_perftest`` (put_bw) has none, its puts being pipelined:
    it is drawn from ``mean_us``, size / bandwidth, and labelled so (bench/reference.py says why it is no
    latency). ``ucx_perftest_lat`` is drawn from its median, half a round trip: the floor of a send/receive.
    """
    lines = []
    for name in _transports_in_order(records):
        rows = records[records["transport"] == name]
        if name in TIME_FROM_MEAN and rows["p50_us"].isna().all():
            lines.append((name, TIME_FROM_MEAN[name], rows["size_bytes"], rows["mean_us"], None))
        else:
            lines.append((name, LABELS.get(name, name), rows["size_bytes"], rows["p50_us"], rows["p99_us"]))
    return lines


def plot_micro(run: Run) -> list[Path]:
    """Figure 8 of the paper (time per transfer against size) and throughput against size, with the reference
    lines: ucx_perftest put_bw (pipelined; on the time figure as size / bandwidth), put_lat (up to 1MB) and memcpy."""
    records = run.records.sort_values("size_bytes")
    written = []

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for name, label, sizes, times, p99 in micro_time_lines(records):
        style = STYLE.get(name, {})
        ax.plot(sizes, times, label=label, **style)
        if p99 is not None and p99.notna().any():
            ax.fill_between(sizes, times, p99, color=style.get("color"), alpha=0.12, linewidth=0)
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


def plot_model(run: Run) -> list[Path]:
    """Figure 9 of the paper (throughput against batch size, per model) and Figure 12 (mini-batch time)."""
    records = run.records.sort_values("batch_size")
    models = list(dict.fromkeys(records["model"]))
    written = []

    columns = min(3, len(models))
    rows = -(-len(models) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 4 * rows), squeeze=False)
    for ax, model in zip(axes.flat, models, strict=False):
        subset = records[records["model"] == model]
        for name in _transports_in_order(subset):
            line = subset[subset["transport"] == name]
            ax.plot(line["batch_size"], line["throughput_batches_per_s"], label=LABELS.get(name, name),
                    **STYLE.get(name, {}))
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(sorted(set(subset["batch_size"]))))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{int(v)}"))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("mini-batch size per worker")
        ax.set_ylabel("mini-batches per second per worker")
        ax.set_title(model)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(models):]:
        ax.set_visible(False)
    servers = ", ".join(str(s) for s in sorted(set(records["servers"])))
    notes = " · ".join(n for n in (_compute_note(records), _launch_note(records)) if n)
    fig.suptitle(f"Training throughput ({servers} server(s))" + (f"\n{notes}" if notes else "") + "\n"
                 + _subtitle(run), fontsize=10)
    fig.tight_layout()
    written += _save(fig, run, "model_throughput")

    # Figure 12: mini-batch time per model for each transport, at the smallest batch size run
    smallest = records[records["batch_size"] == records["batch_size"].min()]
    names = _transports_in_order(smallest)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(models) * max(1, len(names)) / 2), 4.5))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        times = [smallest[(smallest["model"] == m) & (smallest["transport"] == name)]["step_time_s"].mean()
                 for m in models]
        ax.bar([j + i * width for j in range(len(models))], times, width, label=LABELS.get(name, name),
               color=STYLE.get(name, {}).get("color"))
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(models))], models)
    ax.set_ylabel("mini-batch time (s)")
    ax.set_title(f"Mini-batch time, batch size {int(smallest['batch_size'].min())}\n" + _subtitle(run), fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    written += _save(fig, run, "model_step_time")
    if {"zerocopy", "zerocopy:no_analysis"} <= set(records["transport"]):
        written += plot_copy_overhead(run)
    return written


#: Figure 12's bars: the analysis on, off, and the paper's "without analysis" (the sender's copy)
COPY_OVERHEAD = ("zerocopy", "zerocopy:no_analysis", "rdma_cp")


def plot_copy_overhead(run: Run) -> list[Path]:
    """Figure 12 of the paper: mini-batch time per model with the graph analysis on and off, and per step the
    payload bytes copied and the tensors sent from memory that was not registered (at the smallest batch)."""
    records = run.records
    records = records[records["batch_size"] == records["batch_size"].min()]
    names = [n for n in COPY_OVERHEAD if n in set(records["transport"])]
    models = list(dict.fromkeys(records[records["transport"].isin(names)]["model"]))
    fig, (time_ax, copy_ax, miss_ax) = plt.subplots(3, 1, figsize=(max(8.0, 1.3 * len(models) + 2), 11))
    width = 0.8 / len(names)

    def value(model: str, name: str, column: str) -> float:
        rows = records[(records["model"] == model) & (records["transport"] == name)]
        return float(rows[column].mean()) if len(rows) and column in rows else float("nan")

    panels = ((time_ax, "step_time_s", 1.0, "mini-batch time (s)"),
              (copy_ax, "copied_bytes_per_step", 2**-20, "payload copied per step (MB, all processes)"),
              (miss_ax, "unregistered_sends_per_step", 1.0, "tensors sent from unregistered memory per step"))
    for ax, column, scale, label in panels:
        for i, name in enumerate(names):
            heights = [value(m, name, column) * scale for m in models]
            ax.bar([j + i * width for j in range(len(models))], heights, width, label=LABELS.get(name, name),
                   color=STYLE.get(name, {}).get("color"))
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(models))], models)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, axis="y", alpha=0.3)
    for j, model in enumerate(models):  # the gain of the analysis, above each model's bars
        on, off = value(model, "zerocopy", "step_time_s"), value(model, "zerocopy:no_analysis", "step_time_s")
        if on == on and off == off and on > 0:
            top = max(on, off)
            time_ax.annotate(f"{(off / on - 1) * 100:+.0f}%", (j + width * (len(names) - 1) / 2, top),
                             ha="center", va="bottom", fontsize=8)
    time_ax.set_title("mini-batch time (label: the step time with the analysis off, against on)", fontsize=9)
    copy_ax.set_title("copies in user space", fontsize=9)
    miss_ax.set_title("registration-cache misses", fontsize=9)
    handles, labels = time_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(names), fontsize=8, bbox_to_anchor=(0.5, -0.02))
    servers = ", ".join(str(s) for s in sorted(set(records["servers"])))
    notes = " · ".join(n for n in (_compute_note(records), _launch_note(records)) if n)
    fig.suptitle(f"The graph analysis: zero copy against the same transport without it (Figure 12), batch size "
                 f"{int(records['batch_size'].min())}, {servers} server(s)" + (f"\n{notes}" if notes else "")
                 + "\n" + _subtitle(run), fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return _save(fig, run, "copy_overhead")


def plot_scale(run: Run) -> list[Path]:
    """Figure 11 of the paper: total mini-batches per second against servers, per transport, and the Local line.

    The Local line is one process without communication, times the number of servers: what perfect
    scaling of local training would give. A second figure draws the scaling efficiency.
    """
    records = run.records.sort_values("servers")
    panels = list(dict.fromkeys(zip(records["model"], records["batch_size"], strict=True)))
    notes = " · ".join(n for n in (_compute_note(records), _launch_note(records)) if n)
    written = []
    for stem, column, label in (("scale_throughput", "total_batches_per_s", "total mini-batches per second"),
                                ("scale_efficiency", "scaling_efficiency",
                                 "scaling efficiency (throughput / servers x 1-server)")):
        columns = min(3, len(panels))
        rows = -(-len(panels) // columns)
        fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 4.2 * rows), squeeze=False)
        for ax, (model, batch) in zip(axes.flat, panels, strict=False):
            subset = records[(records["model"] == model) & (records["batch_size"] == batch)]
            servers = sorted(set(subset["servers"]))
            for name in _transports_in_order(subset):
                line = subset[subset["transport"] == name]
                if name == "local":  # one process: perfect scaling of it is the reference
                    single = line["total_batches_per_s"].mean()
                    values = [single * n for n in servers] if column == "total_batches_per_s" else [1.0] * len(servers)
                    ax.plot(servers, values, label=LABELS["local"] + " x servers", **STYLE["local"])
                    continue
                ax.plot(line["servers"], line[column], label=LABELS.get(name, name), **STYLE.get(name, {}))
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_locator(FixedLocator(servers))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{int(v)}"))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlabel("servers (each a worker and a parameter server)")
            ax.set_ylabel(label)
            if column == "scaling_efficiency":
                ax.set_ylim(bottom=0)
            ax.set_title(f"{model}, batch {batch} per worker")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        title = "Scalability: throughput against servers" if column != "scaling_efficiency" else "Scaling efficiency"
        fig.suptitle(title + (f"\n{notes}" if notes else "") + "\n" + _subtitle(run), fontsize=10)
        fig.tight_layout()
        written += _save(fig, run, stem)
    return written


def plot_converge(run: Run) -> list[Path]:
    """Figure 10 of the paper: training loss and the held-out metric against wall-clock time, per transport
    (``converge_loss_vs_time``), and the same against steps (``converge_metric_vs_step``), where the curves of
    every transport must coincide: transports change how long training takes, not what it learns."""
    records = run.records
    steps = records[records["kind"] == "step"].sort_values("step")
    evals = records[records["kind"] == "eval"].sort_values("step")
    if steps.empty and evals.empty:
        raise PlotError(f"{run.path}: the converge run has no step or evaluation records to draw")
    settings = run.meta.get("settings", {})
    metric = evals["metric"].dropna().iloc[0] if not evals.empty else settings.get("metric", "metric")
    target = settings.get("target")
    task = settings.get("task", "?")
    written = []
    for stem, x, xlabel in (("converge_loss_vs_time", "wall_s", "seconds trained (evaluation left out)"),
                            ("converge_metric_vs_step", "step", "step")):
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.3))
        for name in _transports_in_order(records):
            style = {**STYLE.get(name, {}), "marker": None}
            line = steps[steps["transport"] == name]
            left.plot(line[x], line["train_loss"], label=LABELS.get(name, name), linewidth=1.2, **style)
            points = evals[evals["transport"] == name]
            right.plot(points[x], points["metric_value"], label=LABELS.get(name, name),
                       **{**STYLE.get(name, {}), "markersize": 4})
        left.set_yscale("log")
        left.set_ylabel("training loss (mean over the workers' batches)")
        right.set_ylabel(f"held-out {metric}")
        if metric == "perplexity":
            right.set_yscale("log")
        if target and target.startswith(f"{metric}="):
            right.axhline(float(target.partition("=")[2]), color="#444444", linestyle=":", linewidth=1,
                          label=f"target {target}")
        for ax in (left, right):
            ax.set_xlabel(xlabel)
            ax.set_xlim(left=0)
            ax.grid(True, alpha=0.3)
        handles, labels = right.get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper center", ncol=min(4, len(labels)), fontsize=8,
                   bbox_to_anchor=(0.5, 0.0), frameon=False)
        against = "time" if x == "wall_s" else "steps (the curves coincide)"
        fig.suptitle(f"Convergence of {task} against {against}\n" + _subtitle(run), fontsize=10)
        fig.tight_layout()
        written += _save(fig, run, stem)
    return written

