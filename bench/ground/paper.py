"""The numbers of Xue et al., *Fast Distributed Deep Learning over RDMA* (EuroSys '19), in one place.

Every figure this suite reproduces is compared with what the paper says about it; those statements live here
and nowhere else, each with the section it comes from and the paper's own words
(``../shared/seeds/xue-eurosys19-fast-distributed-dl-over-rdma.md``). Ratios are speed-ups: how many times
faster (or higher in throughput) zero copy is than the other line; a percentage improvement ``+117%`` is kept
as the ratio ``2.17`` with ``percent=True`` so that it is shown the way the paper states it.

Transport names are this suite's labels (``grpc_tcp`` = gRPC.TCP, ``grpc_rdma`` = gRPC.RDMA, ``rdma_cp`` =
RDMA.cp, ``zerocopy`` = RDMA.zerocp, ``local`` = the "Local" line); model names are those of
:mod:`bench.experiments.models` (``vgg16`` = VGGNet-16, ``inception_v3`` = Inception-v3, ``fcn5`` = FCN-5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.results.lines import GRPC_RDMA, GRPC_TCP, RDMA_CP, ZERO_COPY

CITATION = ("Jilong Xue, Youshan Miao, Cheng Chen, Ming Wu, Lintao Zhang, Lidong Zhou. Fast Distributed Deep "
            "Learning over RDMA. EuroSys '19. https://doi.org/10.1145/3302424.3303975")


@dataclass(frozen=True)
class Claim:
    """One number the paper states: a value, or a range ``low``..``high``, with where and how it says so.

    ``percent``: the paper states it as an improvement in percent (the ratio 2.17 is "+117%").
    ``bound``: ``"more than"`` (the value is a lower bound) or ``"up to"`` (an upper bound), else empty.
    """

    low: float
    high: float | None
    section: str
    quote: str
    percent: bool = False
    bound: str = ""

    def text(self) -> str:
        """The claim as the paper puts it: ``1.7x to 61x``, ``+117% to +145%``, ``more than 7x``."""
        show = _percent if self.percent else _times
        value = show(self.low) if self.high is None else f"{show(self.low)} to {show(self.high)}"
        return f"{self.bound} {value}" if self.bound else value

    def verdict(self, measured: list[float]) -> str:
        """Where measured ratios fall against the claim, in a few words (empty when nothing was measured)."""
        values = [float(v) for v in measured if v is not None and not math.isnan(v)]
        if not values:
            return ""
        low, high = min(values), max(values)
        if self.bound == "up to":  # the paper's best case: how close the best one here comes
            return f"the largest here is {high / self.low:.2g} of the paper's"
        if self.high is None and not self.bound:  # one number: how far from it
            if low == high:
                return f"{low / self.low:.2g} of the paper's"
            return f"{low / self.low:.2g} to {high / self.low:.2g} of the paper's"
        top = math.inf if self.bound == "more than" else (self.high if self.high is not None else self.low)
        if low >= self.low and high <= top:
            return "within the paper's range" if self.high is not None else "as the paper says"
        if high < self.low:
            return "below the paper's"
        if low > top:
            return "above the paper's"
        inside = sum(self.low <= v <= top for v in values)
        below, above = sum(v < self.low for v in values), sum(v > top for v in values)
        outside = ", ".join(f"{n} {where}" for n, where in ((below, "below"), (above, "above")) if n)
        return f"{inside} of {len(values)} within the paper's range ({outside})"


def _times(ratio: float) -> str:
    return f"{ratio:.3g}x"


def _percent(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.0f}%"


# -- the setup (section 5) -------------------------------------------------------------------------------

#: Section 5, "Evaluation": the cluster every number below was measured on
SETUP = {
    "servers": 8,
    "cpu": "dual 2.6 GHz Intel Xeon E5-2690v4, 14 cores each (28 per server)",
    "cores_per_server": 28,
    "memory": "512 GB per server",
    "gpu": "2 NVIDIA Tesla P100 GPUs per server",
    "network": "100 Gbps InfiniBand (Mellanox MT27700 adapters)",
    "software": "Ubuntu 16.04, CUDA 8.0, cuDNN 6, TensorFlow r1.2",
    "rdma": "4 completion queues per device, 4 queue pairs per connection",
}
SETUP_SECTION = "§5 Evaluation"

# -- Figure 8: the send/receive micro-benchmark (section 5.1) -------------------------------------------

#: Section 5.1, Figure 8: how many times faster zero copy (RDMA.zerocp) transfers a tensor than each other
#: transport, over the message sizes of the figure (up to 1 GB; gRPC.RDMA has no 1 GB point: it crashed)
MICRO_SPEEDUP: dict[str, Claim] = {
    GRPC_TCP: Claim(1.7, 61.0, "§5.1, Figure 8",
                    "RDMA.zerocp can improve the speed by 1.7x to 61x over gRPC.TCP for different message sizes"),
    GRPC_RDMA: Claim(1.3, 14.0, "§5.1, Figure 8",
                     "achieves 1.3x to 14x performance improvement compared to gRPC.RDMA for different message "
                     "sizes"),
    RDMA_CP: Claim(1.2, 1.8, "§5.1, Figure 8",
                   "RDMA.zerocp outperforms the RDMA.cp by 1.2x to 1.8x for different message sizes"),
}
#: Section 5.1: the largest tensor of Figure 8
MICRO_MAX_SIZE = 1 << 30

# -- Table 3: GPUDirect RDMA (section 5.2) ------------------------------------------------------------------------

GPUDIRECT = Claim(1.54, None, "§5.2 GPUDirect Support, Table 3",
                  "After enabling GPUDirect, our RDMA further improves the performance by up to 54%.", percent=True,
                  bound="up to")
#: Table 3: average mini-batch time (ms) with RDMA (tensors staged through host memory) and with RDMA+GDR (the NIC
#: reads and writes GPU memory), 8 workers
GPUDIRECT_MINIBATCH_MS = {"AlexNet": (178.5, 135.2), "FCN-5": (157.0, 101.9), "VGGNet": (690.1, 610.4),
                          "Inception": (172.5, 171.9), "LSTM": (84.4, 68.1), "GRU": (62.3, 52.6)}

# -- Table 2: the benchmark models (section 5) ----------------------------------------------------------


@dataclass(frozen=True)
class PaperModel:
    """One row of Table 2 (§5): the model's name in the paper, its size (the sum of its variable tensors, MB),
    its number of variable tensors, and its local computation time per sample (ms, one P100, single server)."""

    name: str
    model_mb: float
    variables: int
    compute_ms_per_sample: float


#: Section 5, Table 2 ("Deep learning benchmarks"), keyed by bench.experiments.models' names
TABLE2: dict[str, PaperModel] = {
    "alexnet": PaperModel("AlexNet", 176.42, 16, 7.61),
    "inception_v3": PaperModel("Inception-v3", 92.90, 196, 68.32),
    "vgg16": PaperModel("VGGNet-16", 512.32, 32, 30.92),
    "lstm": PaperModel("LSTM", 35.93, 14, 33.33),
    "gru": PaperModel("GRU", 27.92, 11, 30.44),
    "fcn5": PaperModel("FCN-5", 204.47, 10, 4.88),
}
TABLE2_SECTION = "§5, Table 2"


def model_name(model: str) -> str:
    """A model as the paper names it (``vgg16`` -> ``VGGNet-16``); a model beyond the paper's as it is."""
    known = TABLE2.get(str(model))
    return known.name if known else str(model)


TABLE2_QUOTE = ("The model size is the sum of the sizes of all the variable tensors in a neural network, which "
                "corresponds to the communication volume between workers and parameter server processes in each "
                "mini-batch. The local computation time represents the average execution time of processing one "
                "sample data in the single-server setting")

# -- Figure 7: the sizes of variable tensors (section 5) ------------------------------------------------

#: Section 5, Figure 7 (over the six benchmarks' variable tensors): the share of tensors above 10 KB and above
#: 1 MB, and the share of all bytes held by tensors above 1 MB (each "more than" in the paper but the last)
TENSOR_SIZES = {"count_above_10KB": 0.50, "count_above_1MB": 0.20, "bytes_above_1MB": 0.96}
TENSOR_SIZES_SECTION = "§5, Figure 7"
TENSOR_SIZES_QUOTE = ("more than 50% of the variable tensors are larger than 10KB, and more than 20% are even larger "
                      "than 1MB. In terms of the total capacity, the tensors that are larger than 1MB occupy 96% of "
                      "the capacity among all tensors")

# -- Figure 9: model throughput (section 5.2, "Performance") --------------------------------------------

#: Section 5.2, "Performance": mini-batch sizes per worker of Figure 9
MODEL_BATCH_SIZES = "1 to 64 (128 for some)"
_FIG9 = "§5.2 Performance, Figure 9"
#: Section 5.2, Figure 9: zero copy's throughput over each other transport's, per model (average improvements)
MODEL_SPEEDUP: dict[tuple[str, str], Claim] = {
    ("vgg16", GRPC_RDMA): Claim(2.17, 2.45, _FIG9, "the average improvements from using RDMA against gRPC.RDMA "
                                                   "range from 117% up to 145% for VGGNet-16", percent=True),
    ("alexnet", GRPC_RDMA): Claim(2.69, None, _FIG9, "The improvements observed for other benchmarks reach 169% for "
                                                     "AlexNet", percent=True),
    ("inception_v3", GRPC_RDMA): Claim(1.65, None, _FIG9, "65% for Inception-v3", percent=True),
    ("fcn5", GRPC_RDMA): Claim(2.51, None, _FIG9, "151% for FCN-5", percent=True),
    ("lstm", GRPC_RDMA): Claim(2.18, None, _FIG9, "118% for LSTM", percent=True),
    ("gru", GRPC_RDMA): Claim(1.69, None, _FIG9, "and 69% for GRU", percent=True),
    ("vgg16", GRPC_TCP): Claim(25.0, None, _FIG9, "the improvements over gRPC.TCP are much greater; for example, "
                                                  "25x for VGGNet-16"),
}
#: Section 5.2, "Performance": the passage of Figure 9's numbers, whole
MODEL_SPEEDUP_QUOTE = ("In general, the average improvements from using RDMA against gRPC.RDMA range from 117% up to "
                       "145% for VGGNet-16. The improvements observed for other benchmarks reach 169% for AlexNet, 65% "
                       "for Inception-v3, 151% for FCN-5, 118% for LSTM, and 69% for GRU. And the improvements over "
                       "gRPC.TCP are much greater; for example, 25x for VGGNet-16")

# -- Figure 10: convergence (section 5.2, "Convergence") ------------------------------------------------

_FIG10 = "§5.2 Convergence, Figure 10"
#: Section 5.2, Figure 10: how many times sooner zero copy reaches the target than each other transport, by task
#: (bench/experiments/tasks.py's names; the paper's SE task has no counterpart here)
CONVERGE_SPEEDUP: dict[tuple[str, str], Claim] = {
    ("seq2seq", GRPC_TCP): Claim(3.0, None, _FIG10, "it takes about 220 minutes to converge to perplexity under 20 "
                                                    "with gRPC.TCP. However, when using our RDMA mechanism, it "
                                                    "takes only 66 minutes, about 3x speedup"),
    ("seq2seq", GRPC_RDMA): Claim(1.53, None, _FIG10, "Even comparing to gRPC.RDMA, our RDMA mechanism achieves 53% "
                                                      "performance improvement", percent=True),
    ("cifar10", GRPC_TCP): Claim(2.6, None, _FIG10, "For the CIFAR model, our RDMA mechanism can speed up "
                                                    "convergence by 2.6x compared to gRPC.TCP"),
    ("cifar10", GRPC_RDMA): Claim(1.18, None, _FIG10, "and 18% to gRPC.RDMA", percent=True),
}
#: the paper's name of each task of Figure 10
CONVERGE_TASKS = {"seq2seq": "Seq2Seq (WMT French-English)", "cifar10": "CIFAR (CIFAR-10)"}
CONVERGE_WORKERS = 8

# -- Figure 11: scalability (section 5.2, "Scalability") ------------------------------------------------

_FIG11 = "§5.2 Scalability, Figure 11"
#: Section 5.2, "Scalability": the mini-batch size per worker and the largest number of servers of Figure 11
SCALE_BATCH_SIZE = 32
SCALE_SERVERS = 8
#: Section 5.2, Figure 11: throughput on 8 servers over the Local line (one process, no communication)
SCALE_OVER_LOCAL: dict[tuple[str, str], Claim] = {
    ("lstm", ZERO_COPY): Claim(5.0, None, _FIG11, "with our RDMA, all the three distributed benchmarks can outperform "
                                                  "the local implementations with only 2 servers. The speedups on 8 "
                                                  "servers are 5x, 7.9x, and 4.3x"),
    ("inception_v3", ZERO_COPY): Claim(7.9, None, _FIG11, "The speedups on 8 servers are 5x, 7.9x, and 4.3x for the "
                                                          "three benchmarks"),
    ("vgg16", ZERO_COPY): Claim(4.3, None, _FIG11, "The speedups on 8 servers are 5x, 7.9x, and 4.3x for the three "
                                                   "benchmarks"),
    ("lstm", GRPC_RDMA): Claim(1.5, None, _FIG11, "for the gRPC.RDMA case, the speedups on 8 servers relative to the "
                                                  "local implementations for LSTM and Inception-v3 are 1.5x and 6x"),
    ("inception_v3", GRPC_RDMA): Claim(6.0, None, _FIG11, "the speedups on 8 servers relative to the local "
                                                          "implementations for LSTM and Inception-v3 are 1.5x and "
                                                          "6x"),
}
#: Section 5.2, Figure 11: throughput on 8 servers over the same transport on one server
SCALE_OVER_ONE_SERVER: dict[tuple[str, str], Claim] = {
    (model, transport): Claim(7.0, None, _FIG11, "the speedup on 8 servers for both RDMA solutions on the two "
                                                 "benchmarks are larger than 7x against their single server cases",
                              bound="more than")
    for model in ("lstm", "inception_v3") for transport in (ZERO_COPY, GRPC_RDMA)
} | {
    ("vgg16", ZERO_COPY): Claim(5.2, None, _FIG11, "our RDMA can still get 5.2x speedup against its single server"),
}
#: Section 5.2, Figure 11: zero copy's throughput over gRPC.RDMA's (on 8 servers; VGG16 at every scale)
SCALE_OVER_GRPC_RDMA: dict[str, Claim] = {
    "lstm": Claim(1.98, None, _FIG11, "our RDMA remains much better than gRPC based RDMA in terms of throughput "
                                      "(i.e., 98% higher for LSTM and 12% for Inception-v3)", percent=True),
    "inception_v3": Claim(1.12, None, _FIG11, "98% higher for LSTM and 12% for Inception-v3", percent=True),
    "vgg16": Claim(2.40, None, _FIG11, "consistently remains more than 140% faster than gRPC based RDMA on different "
                                      "scales", percent=True, bound="more than"),
}

# -- Figure 12: the cost of the sender's copy (section 5.2, "Memory Copy Overhead") ---------------------

#: Section 5.2, "Memory Copy Overhead", Figure 12: mini-batch time with the graph analysis off (the sender
#: copies into registered memory) over on, at most, at mini-batch size 8
COPY_OVERHEAD = Claim(1.21, None, "§5.2 Memory Copy Overhead, Figure 12",
                      "the zero-copy optimization can bring up to 21% performance improvement with mini-batch size of "
                      "8. However, for some benchmarks such as the Inception-v3 and GRU, the performance gain is "
                      "relatively small", percent=True, bound="up to")
COPY_OVERHEAD_BATCH_SIZE = 8
