"""Every line a run can hold, written once: its kind, its name in the paper, its label and its look.

A *line* is what a record's ``transport`` column names: one of this suite's transports, the local baseline,
TensorFlow's own PS over gRPC, a reference line (the machine's or the fabric library's limit) or a peer line (a
library a user could pick instead). Records carry their line's kind (``line_kind``), so a reader groups lines by
what the run wrote, and asks this catalogue only how a line is called and drawn. A name the catalogue does not know
(a line of one's own, a test's) is drawn with a spare colour under its own name, after the known ones.

Adding a peer line is its module under ``bench/experiments/peers/`` and one :class:`Line` here (its
``implementation`` is what the peers' registry loads); adding a reference line is the same under
``bench/experiments/references/`` (a module per tool). Figures, the report, ``bench compare`` and ``--help``
then know it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from bench import LOCAL, TF_GRPC

#: what a line is: one of this suite's transports, the one-process baseline, TensorFlow's PS over gRPC, a reference
#: (the machine's or the fabric library's own limit: never a ratio's base) or a peer (another library, timed as a
#: transport is)
KINDS = ("transport", "local", "tf_grpc", "reference", "peer")
#: the kinds of the lines that measure the machine or another library, not this suite's code
OTHERS_KINDS = ("reference", "peer")
#: ... and of the lines that are not this suite's transports (bench compare counts none of them as a slow-down)
NOT_OURS_KINDS = ("reference", "peer", "tf_grpc")
#: ... and of the lines of the paper's comparisons: this suite's transports and its two baselines (local, tf_grpc)
COMPARED_KINDS = tuple(kind for kind in KINDS if kind not in OTHERS_KINDS)


@dataclass(frozen=True)
class Line:
    """One line of the catalogue (see the module docstring)."""

    name: str
    kind: str
    #: the short name the report's tables give it (the paper's name where the paper has the line)
    paper: str
    #: the name its figures' legends give it
    label: str
    #: its look in every figure (matplotlib line and marker options)
    style: Mapping[str, Any] = field(default_factory=dict)
    #: a reference tool's one micro figure: "time" for a latency tool, "throughput" for a bandwidth tool (its puts
    #: are pipelined: size / bandwidth is no time per transfer); None: both figures draw it
    figure: str | None = None
    #: the fabric whose bandwidth this reference line is (``of_reference`` divides by it), if any
    bandwidth_of: str | None = None
    #: bars of it are hatched: it moves no tensor between processes
    hatched: bool = False
    #: it holds a copy of the tensor on each side beside the tensor (serialised, or a registered bounce buffer)
    copying: bool = False
    #: the paper's line it stands for where the paper has it under another name
    paper_line: str | None = None
    #: ``module:attribute`` of what measures it, and a line saying what it is (reference and peer lines)
    implementation: str | None = None
    about: str = ""
    #: the peer line whose plain loop it is (``bench micro --calibrate``): measured only when asked, beside it
    calibrates: str | None = None
    #: ``bench micro`` measures it (False: a training-only line, e.g. ``torch_ddp``: ``bench model`` runs it)
    micro: bool = True
    #: ``module:attribute`` of the :class:`~bench.experiments.training.TrainingLine` that trains it, for a line of
    #: the training figures that is not one of this suite's transports (those train over the PS runtime)
    training: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"line '{self.name}': unknown kind '{self.kind}' (known: {', '.join(KINDS)})")


_PEER_LOOK = {"linestyle": (0, (5, 2))}  # peers: thin and dashed beside the transports


def _peer(name: str, paper: str, label: str, color: str, marker: str, measured_by: str | None, about: str,
          hollow: bool = True, trained_by: str | None = None) -> Line:
    """A peer line: dashed, its marker hollow unless told, measured by ``bench.experiments.peers.<measured_by>``
    (None: a training-only line, which ``bench model`` runs and ``bench micro`` does not) and trained by
    ``bench.experiments.<trained_by>`` (None: no training line)."""
    style = {"color": color, "marker": marker, **({"markerfacecolor": "none"} if hollow else {}), **_PEER_LOOK}
    return Line(name, "peer", paper, label, style, about=about, micro=measured_by is not None,
                implementation=measured_by and f"bench.experiments.peers.{measured_by}",
                training=trained_by and f"bench.experiments.{trained_by}")


_CATALOGUE: dict[str, Line] = {line.name: line for line in (
    Line(LOCAL, "local", "Local", "Local (no transfer)", {"color": "#444444", "marker": "s", "linestyle": "--"},
         hatched=True, training="bench.experiments.training:LocalTraining"),
    # this suite's transports, from the RPC baseline to zero copy (the report's tables take them the other way)
    Line("grpc_tcp", "transport", "gRPC.TCP", "gRPC.TCP", {"color": "#d62728", "marker": "o"}, copying=True),
    Line("grpc_rdma:direct", "transport", "gRPC.RDMA direct", "gRPC.RDMA direct (0-copy)",
         {"color": "#bcbd22", "marker": "<"}),
    Line("grpc_rdma", "transport", "gRPC.RDMA", "gRPC.RDMA (buffered)", {"color": "#ff7f0e", "marker": "v"},
         copying=True),
    Line("rdma_cp", "transport", "RDMA.cp", "RDMA.cp", {"color": "#2ca02c", "marker": "^"}, copying=True),
    Line("zerocopy:no_analysis", "transport", "RDMA.zerocp (analysis off)",
         "RDMA.zerocp, analysis off (dynamic allocation)", {"color": "#17becf", "marker": "d"}),
    Line("zerocopy", "transport", "RDMA.zerocp", "RDMA.zerocp", {"color": "#1f77b4", "marker": "D"}),
    Line("ucx_perftest", "reference", "ucx_perftest put_bw", "ucx_perftest put_bw (library limit)",
         {"color": "#9467bd", "linestyle": ":", "marker": "x"},
         figure="throughput", bandwidth_of="ucx",
         implementation="bench.experiments.references.ucx_perftest:UcxPerftest",
         about="UCX's put bandwidth (ucx_perftest -t ucp_put_bw)"),
    Line("ucx_perftest_lat", "reference", "ucx_perftest put_lat",
         "ucx_perftest put_lat (half a round trip: latency floor)",
         {"color": "#e377c2", "linestyle": ":", "marker": "1"}, figure="time",
         implementation="bench.experiments.references.ucx_perftest:UcxPerftestLatency",
         about="UCX's put latency (ucx_perftest -t ucp_put_lat), up to 1 MiB"),
    Line("ib_write_bw", "reference", "ib_write_bw", "ib_write_bw (the NIC's write bandwidth)",
         {"color": "#9467bd", "linestyle": ":", "marker": "x"},
         figure="throughput", bandwidth_of="verbs",
         implementation="bench.experiments.references.ib_write:IbWriteBw",
         about="perftest's RDMA write bandwidth (verbs fabric)"),
    Line("ib_write_lat", "reference", "ib_write_lat", "ib_write_lat (the NIC's write latency)",
         {"color": "#e377c2", "linestyle": ":", "marker": "1"}, figure="time",
         implementation="bench.experiments.references.ib_write:IbWriteLat",
         about="perftest's RDMA write latency (verbs fabric)"),
    Line("memcpy", "reference", "memcpy", "memcpy in one process",
         {"color": "#8c564b", "linestyle": "-.", "marker": "+"}, hatched=True,
         implementation="bench.experiments.references.memcpy:Memcpy", about="one copy of the tensor in one process"),
    Line("mpi_plain", "reference", "MPI plain loop", "MPI Send/Recv in a plain loop (the mpi line's calibration)",
         {"color": "#000000", "linestyle": ":", "marker": "o", "markerfacecolor": "none"},
         implementation="bench.experiments.peers.mpi:MpiPlainLine",
         about="mpi4py Send/Recv in the ten lines a user writes: what the harness costs the mpi line (the mpi extra)",
         calibrates="mpi"),
    Line("mpi_rma_plain", "reference", "MPI one-sided plain loop",
         "MPI one-sided put + flag in a plain loop (the mpi_rma line's calibration)",
         {"color": "#555555", "linestyle": ":", "marker": "s", "markerfacecolor": "none"},
         implementation="bench.experiments.peers.mpi:MpiRmaPlainLine",
         about="mpi4py Put, Flush, Put of a flag, Flush in a plain loop: what the harness costs the mpi_rma line",
         calibrates="mpi_rma"),
    Line("socket_plain", "reference", "TCP socket plain loop",
         "a TCP socket in a plain loop (the socket line's calibration)",
         {"color": "#a0522d", "linestyle": ":", "marker": "h", "markerfacecolor": "none"},
         implementation="bench.experiments.peers.plain_socket:PlainSocketLine",
         about="sendmsg and recv_into in a plain loop: what the harness costs the socket line",
         calibrates="socket"),
    Line("nixl_plain", "reference", "NIXL plain loop",
         "NIXL write + notification in a plain loop (the nixl line's calibration)",
         {"color": "#76b900", "linestyle": ":", "marker": "P", "markerfacecolor": "none"},
         implementation="bench.experiments.peers.nixl:PlainNixlLine",
         about="NIXL's transfer, its state polled, and the receiver's notifications in a plain loop: what the "
               "harness costs the nixl line",
         calibrates="nixl"),
    Line("mooncake_plain", "reference", "Mooncake TE plain loop",
         "Mooncake write + flag in a plain loop (the mooncake line's calibration)",
         {"color": "#e7298a", "linestyle": ":", "marker": "*", "markerfacecolor": "none"},
         implementation="bench.experiments.peers.mooncake:PlainMooncakeLine",
         about="Mooncake's transfer_sync_write of the tensor, then of a flag the receiver polls, in a plain loop: "
               "what the harness costs the mooncake line",
         calibrates="mooncake"),
    Line("torch_gloo_plain", "reference", "torch gloo plain loop",
         "torch.distributed send/recv over gloo in a plain loop (the torch_gloo line's calibration)",
         {"color": "#ee4c2c", "linestyle": ":", "marker": "X", "markerfacecolor": "none"},
         implementation="bench.experiments.peers.torch_gloo:PlainGlooLine",
         about="torch.distributed's send and recv (gloo) of a CPU tensor in a plain loop: what the harness costs the "
               "torch_gloo line (the torch extra)",
         calibrates="torch_gloo"),
    Line("torch_rpc_plain", "reference", "torch RPC plain loop",
         "torch.distributed.rpc rpc_sync over TensorPipe in a plain loop (the torch_rpc line's calibration)",
         {"color": "#812ce5", "linestyle": ":", "marker": "p", "markerfacecolor": "none"},
         implementation="bench.experiments.peers.torch_rpc:PlainRpcLine",
         about="rpc_sync of the tensor to a function of the receiver's in a plain loop: what the harness costs the "
               "torch_rpc line (the torch extra)",
         calibrates="torch_rpc"),
    Line("harness", "reference", "harness (null transfer)", "the harness alone (a transfer that moves nothing)",
         {"color": "#bbbbbb", "linestyle": ":", "marker": "."}, hatched=True,
         implementation="bench.experiments.references.null:NullLine",
         about="the harness measuring itself: the same loops over a link that moves nothing, below 64KB"),
    Line(TF_GRPC, "tf_grpc", "TF gRPC (tf_grpc)", "TensorFlow PS over gRPC (today)",
         {"color": "#7f7f7f", "marker": "*", "linestyle": "-."}, paper_line="grpc_tcp",
         training="bench.experiments.training:TfGrpcTraining"),
    _peer("mpi", "MPI Send/Recv", "MPI Send/Recv (peer: Open MPI)", "#000000", "o", "mpi:MpiLine",
          "MPI point-to-point: mpi4py Send/Recv (the mpi extra)"),
    _peer("mpi_rma", "MPI one-sided put", "MPI one-sided put + flag (peer)", "#555555", "s", "mpi:MpiRmaLine",
          "MPI one-sided: Put, flush, Put of a flag, flush; the receiver polls the flag (the mpi extra)"),
    _peer("nixl", "NIXL", "NIXL write + notification (peer)", "#76b900", "P", "nixl:NixlLine",
          "NVIDIA NIXL over UCX, host memory: a write into the receiver's tensor and a notification", hollow=False),
    _peer("mooncake", "Mooncake TE", "Mooncake transfer engine, tcp (peer)", "#e7298a", "*", "mooncake:MooncakeLine",
          "Mooncake's transfer engine over tcp: a write of the tensor, then of a flag the receiver polls"),
    _peer("socket", "TCP socket", "TCP socket (peer)", "#a0522d", "h", "plain_socket:SocketLine",
          "a plain TCP socket: sendmsg of a length and the bytes, recv_into a preallocated buffer"),
    _peer("torch_gloo", "torch gloo", "torch.distributed send/recv, gloo (peer: PyTorch)", "#ee4c2c", "X",
          "torch_gloo:GlooLine", "PyTorch's torch.distributed: send and recv of a CPU tensor over gloo (the torch "
          "extra)", hollow=False),
    _peer("torch_rpc", "torch RPC", "torch.distributed.rpc over TensorPipe (peer: PyTorch)", "#812ce5", "p",
          "torch_rpc:RpcLine", "PyTorch's torch.distributed.rpc: rpc_sync carrying the tensor to a function of the "
          "receiver's, over TensorPipe (shm/cma on one host; the torch extra)", hollow=False,
          trained_by="torch_training:TorchRpcTraining"),
    _peer("torch_ddp", "PyTorch DDP", "PyTorch DDP (all-reduce)", "#fdae6b", ">", None,
          "PyTorch's DistributedDataParallel: gradients all-reduced (gloo on the CPU, NCCL on a GPU); bench model "
          "only", hollow=False, trained_by="torch_training:TorchDdpTraining"),
)}

#: the lines the readers single out by name (the paper's comparisons are about them)
ZERO_COPY = "zerocopy"
NO_ANALYSIS = "zerocopy:no_analysis"
RDMA_CP = "rdma_cp"
GRPC_TCP = "grpc_tcp"
GRPC_RDMA = "grpc_rdma"
#: PyTorch's own lines (a micro peer and a training line; a training-only line)
TORCH_RPC = "torch_rpc"
TORCH_DDP = "torch_ddp"

#: colours for names the catalogue does not know, chosen by the name (the same in every figure)
_SPARE_COLORS = ("#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354")


def line(name: str, kind: str | None = None) -> Line:
    """The catalogue's line ``name``; one it does not know is of ``kind`` (a record's ``line_kind``; default
    transport), called by its name and drawn in a spare colour."""
    known = _CATALOGUE.get(name)
    if known is not None:
        return known
    spare = _SPARE_COLORS[sum(map(ord, name)) % len(_SPARE_COLORS)]
    chosen = kind if kind in KINDS else "transport"
    return Line(name, chosen, name, name, {"color": spare, "marker": "o", **(_PEER_LOOK if chosen == "peer" else {})})


def known(name: str) -> bool:
    return name in _CATALOGUE


def kind_of(name: str) -> str:
    """The kind of line ``name`` (a name the catalogue does not know is a transport)."""
    return line(name).kind


def names(kind: str) -> tuple[str, ...]:
    """The lines of ``kind`` the catalogue knows, in its order."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind of line '{kind}' (known: {', '.join(KINDS)})")
    return tuple(name for name, entry in _CATALOGUE.items() if entry.kind == kind)


def micro_peers() -> tuple[str, ...]:
    """The peer lines ``bench micro`` measures, in the catalogue's order (not the training-only ones)."""
    return tuple(entry.name for entry in of_kind("peer") if entry.micro)


def of_kind(kind: str) -> Iterator[Line]:
    """The lines of ``kind`` the catalogue knows, in its order."""
    return (_CATALOGUE[name] for name in names(kind))


def order(present: Iterable[str]) -> list[str]:
    """The lines once each, in the catalogue's order (the order of legends), others after them by name."""
    position = {name: index for index, name in enumerate(_CATALOGUE)}
    return sorted(dict.fromkeys(present), key=lambda name: (position.get(name, len(position)), name))


#: the order of kinds in the report's tables
_TABLE_KINDS = ("transport", "tf_grpc", "local", "peer", "reference")


def table_order(present: Iterable[str], kinds: Mapping[str, str] | None = None) -> list[str]:
    """The lines once each in the order of the report's tables: this suite's transports from zero copy down to the
    RPC baseline, then TensorFlow's, local, the peers and the references; lines the catalogue does not know after
    the known ones of their kind (``kinds``: a record's ``line_kind`` by name), by name."""
    position = {name: index for index, name in enumerate(_CATALOGUE)}

    def key(name: str) -> tuple:
        kind = line(name, (kinds or {}).get(name)).kind
        if name not in position:
            return _TABLE_KINDS.index(kind), 1, 0, name
        index = position[name]
        return _TABLE_KINDS.index(kind), 0, -index if kind == "transport" else index, name
    return sorted(dict.fromkeys(present), key=key)


def calibrations() -> Iterator[Line]:
    """The lines that calibrate a peer line (its plain loop), in the catalogue's order."""
    return (entry for entry in _CATALOGUE.values() if entry.calibrates)


def trained() -> Iterator[Line]:
    """The lines with a training line of their own (:attr:`Line.training`), in the catalogue's order."""
    return (entry for entry in _CATALOGUE.values() if entry.training)


def bandwidth_reference(fabric: str) -> str | None:
    """The reference line whose bandwidth a run on backend ``fabric`` divides by (``of_reference``), if any."""
    return next((entry.name for entry in _CATALOGUE.values() if entry.bandwidth_of == fabric), None)


def bandwidth_references() -> tuple[str, ...]:
    """Every reference line that is a fabric's bandwidth."""
    return tuple(entry.name for entry in _CATALOGUE.values() if entry.bandwidth_of)


def kinds_in(records: Any) -> dict[str, str]:
    """Each line of ``records`` (a frame with ``transport``, records or points) -> its kind: as the records say
    (``line_kind``), else the catalogue's."""
    if "transport" not in records:
        return {}
    given = records["line_kind"] if "line_kind" in records else [None] * len(records)
    return {str(name): str(kind) if isinstance(kind, str) and kind in KINDS else line(str(name)).kind
            for name, kind in zip(records["transport"], given, strict=True)}


@contextmanager
def added(*new: Line) -> Iterator[None]:
    """The catalogue with ``new`` lines in it, for the duration (a test's line; a line being tried out)."""
    clashing = [entry.name for entry in new if entry.name in _CATALOGUE]
    if clashing:
        raise ValueError(f"the catalogue already has {', '.join(clashing)}")
    _CATALOGUE.update((entry.name, entry) for entry in new)
    try:
        yield
    finally:
        for entry in new:
            _CATALOGUE.pop(entry.name, None)
