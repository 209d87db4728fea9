"""The graph analyzer (the paper's section 3.4): which tensors cross processes, static or dynamic, and where.

A framework traces the step a worker runs every mini-batch (TensorFlow: the ``tf.function`` graph,
``bench.runtime.tensorflow_bridge``; PyTorch: one step under autograd, ``bench.runtime.torch_bridge``) and
says what it gives for each variable (:class:`Output`); this module turns that into the plan, framework-free.
In the parameter-server layout the tensors that cross processes are, per variable:

* a trainable variable's value (``w<i>``), from its parameter server (PS) to every worker, and its
  gradient back (``g<i>``). A dense gradient has the shape the trace gives it; an embedding table's
  gradient is sparse (TensorFlow's ``IndexedSlices``, PyTorch's sparse COO tensor: the rows the batch
  looked up), sent as its distinct rows (``g<i>.values``) and their row numbers (``g<i>.indices``): how
  many rows that is changes every step, so both are *dynamic*, with the trace's row count as their bound;
* a non-trainable variable (BatchNorm's moving statistics: *state*), kept by the PS as
  TensorFlow's PS training keeps it: its value goes to every worker with the weights (``s<i>``),
  and each worker's update of it comes back (``u<i>``, the step's new value of the variable).

A tensor whose shape is fully known in the trace is placed statically (the receiver preallocates
it in registered memory and the sender writes into it); the others go by dynamic allocation. For
each sent tensor the plan names its *site*: where the framework allocates it (TensorFlow: the graph
operation, found by walking back through the operations that only forward a buffer, ``Identity``);
at run time the runtime traces where those tensors actually are (``bench.runtime.sites``).

``Plan.specs(rank)`` is what the runtime hands to ``Placement.plan`` (a transport's ``placement``);
``bench analyze`` prints it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from transports import TensorSpec
from transports.memory import HOST, Memory

#: where tensors the parameter servers send come from (memory the transport gives them)
PS_SITE = "parameter server (transport memory)"
#: where the distinct rows of a sparse gradient are written (memory the transport gives the worker)
DEDUP_SITE = "worker: distinct rows summed into transport memory"


@dataclass(frozen=True)
class Variable:
    """A model variable: its index among all the model's variables, path, shape and dtype.

    ``trainable`` variables are trained by gradients; the others (*state*, e.g. BatchNorm's moving
    statistics) are updated by the forward pass. ``sparse_rows`` is non-zero for a variable whose
    gradient is ``IndexedSlices``: the most rows one gradient can carry (from the graph).
    """

    index: int
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    trainable: bool = True
    sparse_rows: int = 0

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def sparse(self) -> bool:
        return self.sparse_rows > 0


@dataclass(frozen=True)
class Layout:
    """Ranks of a cluster of ``servers`` servers, each running a worker and a parameter server."""

    servers: int

    def worker(self, server: int) -> int:
        return server

    def ps(self, server: int) -> int:
        return self.servers + server

    @property
    def size(self) -> int:
        return 2 * self.servers

    def ps_of(self, variable: Variable) -> int:
        """Variables are placed round-robin over the parameter servers, as in the paper."""
        return self.ps(variable.index % self.servers)

    def role(self, rank: int) -> str:
        return f"worker {rank}" if rank < self.servers else f"ps {rank - self.servers}"


def weight_key(variable: Variable) -> str:
    """The name of the variable's value as the PS sends it: ``w<i>`` (trainable) or ``s<i>`` (state)."""
    return f"w{variable.index}" if variable.trainable else f"s{variable.index}"


def gradient_key(variable: Variable) -> str:
    """The name of what a worker sends back: the gradient ``g<i>``, or the state's new value ``u<i>``."""
    return f"g{variable.index}" if variable.trainable else f"u{variable.index}"


def update_keys(variable: Variable) -> list[str]:
    """Every tensor a worker sends for ``variable`` each step: one, or a sparse gradient's two."""
    key = gradient_key(variable)
    return [f"{key}.values", f"{key}.indices"] if variable.sparse else [key]


@dataclass(frozen=True)
class Transfer:
    """One cross-process tensor of the plan.

    ``shape`` is None for a dynamic tensor; ``bound`` is then the largest shape it can take (None
    when the graph gives no bound). ``site`` is what produces it (a graph operation, or memory the
    transport gives).
    """

    name: str
    role: str  # weight, gradient, state, state update
    variable: str
    shape: tuple[int, ...] | None
    bound: tuple[int, ...] | None
    dtype: np.dtype
    src: int
    dst: int
    site: str

    @property
    def static(self) -> bool:
        return self.shape is not None

    @property
    def nbytes(self) -> int | None:
        """Its bytes (static), or the most it can have (dynamic with a bound); None when unbounded."""
        shape = self.shape if self.shape is not None else self.bound
        if shape is None:
            return None
        return int(np.prod(shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def spec(self, memory: Memory | str = HOST) -> TensorSpec:
        """What a transport's placement takes for this tensor, living in ``memory`` on both sides (the run's)."""
        return TensorSpec(self.name, self.shape, self.dtype, self.src, self.dst, memory, memory)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "variable": self.variable,
                "placement": "static" if self.static else "dynamic",
                "shape": None if self.shape is None else list(self.shape),
                "bound": None if self.bound is None else list(self.bound), "dtype": np.dtype(self.dtype).str,
                "bytes": self.nbytes, "src": self.src, "dst": self.dst, "site": self.site}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Transfer:
        shape = None if data["shape"] is None else tuple(data["shape"])
        bound = None if data["bound"] is None else tuple(data["bound"])
        return cls(data["name"], data["role"], data["variable"], shape, bound, np.dtype(data["dtype"]),
                   int(data["src"]), int(data["dst"]), data["site"])


@dataclass(frozen=True)
class Plan:
    """The analyzer's result: the variables, every cross-process tensor, and the registered memory it needs."""

    model: str
    servers: int
    batch_size: int
    variables: tuple[Variable, ...]
    transfers: tuple[Transfer, ...] = field(repr=False)
    #: False: the plan of a run with the analysis off (every tensor dynamic, nothing preallocated)
    analysis: bool = True

    @property
    def layout(self) -> Layout:
        return Layout(self.servers)

    @property
    def trainable(self) -> list[Variable]:
        return [v for v in self.variables if v.trainable]

    @property
    def state(self) -> list[Variable]:
        return [v for v in self.variables if not v.trainable]

    def of(self, rank: int) -> list[Transfer]:
        """The tensors rank ``rank`` sends or receives."""
        return [t for t in self.transfers if rank in (t.src, t.dst)]

    def specs(self, rank: int | None = None, memory: Memory | str = HOST) -> list[TensorSpec]:
        """What ``Placement.plan`` takes: every tensor (of ``rank``, when given), in ``memory`` (the run's)."""
        transfers = self.transfers if rank is None else self.of(rank)
        return [t.spec(memory) for t in transfers]

    def transfer(self, name: str, src: int, dst: int) -> Transfer:
        for t in self.transfers:
            if (t.name, t.src, t.dst) == (name, src, dst):
                return t
        raise KeyError(f"no tensor '{name}' from rank {src} to rank {dst} in the plan")

    def pool_bytes(self, rank: int) -> int:
        """Registered memory rank ``rank`` needs: what it receives (static slots, dynamic bounds) and what it
        sends from memory the transport gives it (the PS's values, a worker's sparse rows), once per tensor."""
        received = sum(t.nbytes or 0 for t in self.of(rank) if t.dst == rank)
        sent = {t.name: t.nbytes or 0 for t in self.of(rank) if t.src == rank and t.site in (PS_SITE, DEDUP_SITE)}
        return received + sum(sent.values())

    def without_analysis(self) -> Plan:
        """The same tensors with the analysis off: no shape known ahead, everything by dynamic allocation."""
        return replace(self, analysis=False,
                       transfers=tuple(replace(t, shape=None, bound=t.shape or t.bound) for t in self.transfers))

    def for_servers(self, servers: int) -> Plan:
        """This plan laid out for ``servers``: the same variables and per-worker updates, placed as :func:`plan_from`
        places them (round-robin over the parameter servers), the model not built again."""
        if servers == self.servers:
            return self
        worker = self.layout.worker(0)
        by_path = {v.path: v for v in self.variables}
        outputs: dict[int, Output] = {}
        for t in self.transfers:
            if t.src != worker:
                continue
            variable = by_path[t.variable]
            if t.name.endswith(".indices"):  # a sparse gradient: its rows and their indices
                outputs[variable.index] = Output(None, variable.dtype, t.site, index_dtype=t.dtype)
            elif not t.name.endswith(".values"):
                outputs[variable.index] = Output(t.shape, t.dtype, t.site)
        laid = plan_from(self.model, list(self.variables), outputs, servers, self.batch_size)
        return laid if self.analysis else laid.without_analysis()

    def summary(self) -> dict[str, Any]:
        static = [t for t in self.transfers if t.static]
        dynamic = [t for t in self.transfers if not t.static]
        return {
            "tensors": len(self.transfers), "static": len(static), "dynamic": len(dynamic),
            "static_bytes": sum(t.nbytes for t in static),
            "dynamic_bound_bytes": sum(t.nbytes or 0 for t in dynamic),
            "pool_bytes": {self.layout.role(rank): self.pool_bytes(rank) for rank in range(self.layout.size)},
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "servers": self.servers, "batch_size": self.batch_size, "analysis": self.analysis,
            "variables": [{"index": v.index, "path": v.path, "shape": list(v.shape), "dtype": np.dtype(v.dtype).str,
                           "trainable": v.trainable, "sparse_rows": v.sparse_rows} for v in self.variables],
            "transfers": [t.to_json() for t in self.transfers],
            "summary": self.summary(),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        variables = tuple(Variable(v["index"], v["path"], tuple(v["shape"]), np.dtype(v["dtype"]), v["trainable"],
                                   v["sparse_rows"]) for v in data["variables"])
        return cls(data["model"], data["servers"], data["batch_size"], variables,
                   tuple(Transfer.from_json(t) for t in data["transfers"]), data.get("analysis", True))


# -- reading the graph ---------------------------------------------------------------------------


#: dense gradients handed to the transport together once backpropagation has computed about this many bytes of
#: them (the last weights' first): one Python call into the step's graph per bucket, not per gradient (PyTorch's
#: DDP buckets its gradients' all-reduce at 25 MB alike). Inception-v3's 190 gradients, one call each, slowed its
#: backward pass by 0.14 s a step on 2 cores
GRADIENT_BUCKET_BYTES = 25 << 20


def gradient_buckets(nbytes: list[int | None], bucket_bytes: int = GRADIENT_BUCKET_BYTES) -> list[list[int]]:
    """The positions of the dense gradients (``nbytes[i]`` their bytes; None: a sparse one, in no bucket), last
    weights first (the order backpropagation computes them in), cut into buckets of at least ``bucket_bytes`` (the
    last may hold less)."""
    buckets: list[list[int]] = []
    bucket: list[int] = []
    filled = 0
    for i in reversed(range(len(nbytes))):
        if nbytes[i] is None:
            continue
        bucket.append(i)
        filled += nbytes[i]
        if filled >= bucket_bytes:
            buckets.append(bucket)
            bucket, filled = [], 0
    if bucket:
        buckets.append(bucket)
    return buckets


@dataclass(frozen=True)
class Output:
    """What a worker's step gives for one variable, as the framework's trace of the step saw it: a dense update
    (a gradient or a state's new value) of ``shape`` (None where the trace leaves it open), or, with
    ``index_dtype``, a sparse gradient's rows (at most the variable's ``sparse_rows``) and their indices."""

    shape: tuple[int, ...] | None
    dtype: np.dtype
    #: where the framework allocates it (a graph operation, an autograd function)
    site: str
    index_dtype: np.dtype | None = None


def plan_from(name: str, variables: list[Variable], outputs: dict[int, Output], servers: int,
              batch_size: int) -> Plan:
    """The plan of a model of ``variables`` whose step gives ``outputs`` (by variable index), over ``servers``
    servers (see the module): every variable's value from its PS to every worker, and its update back."""
    layout = Layout(servers)
    transfers: list[Transfer] = []
    for variable in variables:
        ps = layout.ps_of(variable)
        role = "weight" if variable.trainable else "state"
        for server in range(servers):
            worker = layout.worker(server)
            transfers.append(Transfer(weight_key(variable), role, variable.path, variable.shape, None,
                                      variable.dtype, ps, worker, PS_SITE))
            transfers.extend(_updates(variable, outputs[variable.index], worker, ps))
    return Plan(name, servers, batch_size, tuple(variables), tuple(transfers))


def _updates(variable: Variable, output: Output, worker: int, ps: int) -> list[Transfer]:
    """What a worker sends for ``variable``: its gradient (dense, or a sparse one's two parts) or new state."""
    key = gradient_key(variable)
    role = "gradient" if variable.trainable else "state update"
    if output.index_dtype is not None:
        rows, rest = variable.sparse_rows, variable.shape[1:]
        return [Transfer(f"{key}.values", role, variable.path, None, (rows, *rest), variable.dtype, worker, ps,
                         DEDUP_SITE),
                Transfer(f"{key}.indices", role, variable.path, None, (rows,), np.dtype(output.index_dtype), worker,
                         ps, DEDUP_SITE)]
    return [Transfer(key, role, variable.path, output.shape, None, np.dtype(output.dtype), worker, ps, output.site)]


def format_size(nbytes: int) -> str:
    """Bytes for a person: ``800 B``, ``256.0 KB``, ``24.4 MB`` (binary units)."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def format_plan(plan: Plan, limit: int | None = None) -> str:
    """The plan as a table a person reads: one line per tensor and direction (workers folded), then the pools."""
    rows = []
    seen: set[str] = set()
    layout = plan.layout
    for t in plan.transfers:  # one line per tensor: the same tensor to or from every worker is one line
        if t.name in seen:
            continue
        seen.add(t.name)
        workers = "workers" if plan.servers > 1 else layout.role(0)
        outward = t.role in ("weight", "state")
        source, destination = (layout.role(t.src), workers) if outward else (workers, layout.role(t.dst))
        shape = "x".join(map(str, t.shape)) if t.shape is not None else \
            ("<=" + "x".join(map(str, t.bound)) if t.bound is not None else "?")
        size = format_size(t.nbytes) if t.nbytes is not None else "?"
        rows.append((t.name, t.role, "static" if t.static else "dynamic", shape or "scalar", size, source,
                     destination, t.variable, t.site))
    header = ("tensor", "role", "placement", "shape", "bytes", "source", "destination", "variable", "site")
    shown = rows if limit is None else rows[:limit]
    widths = [max(len(str(r[i])) for r in [header, *shown]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in [header, *shown]]
    if limit is not None and len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more (--all shows every tensor, --json writes them)")
    summary = plan.summary()
    lines.append("")
    lines.append(f"{summary['tensors']} cross-process tensors over {plan.servers} server(s): "
                 f"{summary['static']} static ({format_size(summary['static_bytes'])}), "
                 f"{summary['dynamic']} dynamic (at most {format_size(summary['dynamic_bound_bytes'])})")
    lines.append("registered memory per process: " + ", ".join(
        f"{role} {format_size(size)}" for role, size in summary["pool_bytes"].items()))
    return "\n".join(lines)
