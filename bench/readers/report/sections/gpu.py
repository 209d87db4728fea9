"""Table 3, tensors in GPU memory (``bench micro --memory cuda`` runs): per size, each transport's time on device
memory, the crossings of the bus its ledger counted (staging through the host), zero copy's speed-up over gRPC over
TCP, and zero copy's throughput against UCX's own puts on device memory, beside the paper's GPUDirect numbers.
"""

from __future__ import annotations

from bench.ground import paper
from bench.ground.sizes import format_size
from bench.readers.report.page import Section, Table
from bench.readers.report.text import (
    ZERO_COPY,
    column_cell,
    line_name,
    lines_of,
    missing,
    num,
    percent,
    quote,
    ratio_cell,
)
from bench.results import Run
from bench.results.lines import GRPC_TCP

#: the line zero copy's speed-up on device memory is taken against (TensorFlow's GPU RecvTensor over gRPC)
RPC = GRPC_TCP


def table3(run: Run, label: str) -> Section | None:
    """The section of a micro run whose tensors lived in device memory on a side; None for a host-memory run."""
    points = run.points(also=("of_reference",))
    if "sender_memory" not in points:
        return None
    memory = points.loc[points["line_kind"] != "reference", ["sender_memory", "receiver_memory"]].drop_duplicates()
    on_device = [(s, r) for s, r in memory.itertuples(index=False) if "cuda" in f"{s}{r}"]
    if not on_device:
        return None
    sender, receiver = on_device[0]
    section = Section("table3", f"Table 3: tensors in GPU memory ({sender} to {receiver})", run, label,
                      paper=[quote(paper.GPUDIRECT)])
    lines = lines_of(points, "transport", "peer")
    sizes = sorted({int(s) for s in points["size_bytes"]})
    point = {(r["transport"], int(r["size_bytes"])): r for _, r in points.iterrows()}

    def crossings(line: str, size: int) -> str:
        row = point.get((line, size))
        if row is None:
            return num(None)
        moved = [row.get("device_to_host_bytes_per_transfer"), row.get("host_to_device_bytes_per_transfer")]
        if all(missing(v) for v in moved):
            return num(None)
        return num(sum(0 if missing(v) else v for v in moved) / size)

    header = ["size", *[f"{line_name(t)} p50 (µs)" for t in lines], *[f"{line_name(t)} bus crossings" for t in lines],
              *([f"{line_name(RPC)} / {line_name(ZERO_COPY)}"] if RPC in lines and ZERO_COPY in lines else []),
              "of UCX's own on device memory (put bw)"]
    rows = []
    for size in sizes:
        row = [format_size(size), *[num(point.get((t, size), {}).get("p50_us")) for t in lines],
               *[crossings(t, size) for t in lines]]
        if RPC in lines and ZERO_COPY in lines:
            row.append(ratio_cell(point.get((RPC, size)), point.get((ZERO_COPY, size)), "p50_us"))
        row.append(column_cell(point.get((ZERO_COPY, size)), "of_reference", num))
        rows.append(row)
    section.tables.append(Table("table3-here", "Each transport on device memory: median time per transfer, the "
                                "payload's crossings of the bus per transfer (device to host plus host to device, "
                                "both sides, over the tensor's size: 2 is staged through the host at each end, 0 "
                                "moved device to device), how many times faster zero copy is than gRPC over TCP, "
                                "and zero copy's throughput over ucx_perftest -m cuda's put bandwidth", header, rows))
    section.tables.append(Table("table3-paper", "The paper's Table 3: mean mini-batch time (ms), 8 workers, RDMA "
                                "staging through host memory against RDMA with GPUDirect (the NIC reads and writes "
                                "GPU memory)", ["benchmark", "RDMA", "RDMA+GDR", "improvement"],
                                [[name, num(rdma), num(gdr), percent(rdma / gdr)]
                                 for name, (rdma, gdr) in paper.GPUDIRECT_MINIBATCH_MS.items()]))
    staged = [t for t in lines if any(crossings(t, s) not in (num(None), "0") for s in sizes)]
    if staged:
        section.notes.append(f"Staged through host memory here: {', '.join(map(line_name, staged))} (their ledgers "
                             "count the crossings). The paper's RDMA column is this staging; its RDMA+GDR column "
                             "needs the fabric to move device memory itself, which a transport with 0 crossings "
                             "does.")
    return section
