"""One parameter-server training step at any scale, simulated event by event with SimPy (issue 62, item 2).

**The model.** Every server is one host running a worker and a parameter server (PS); variables are placed on the
PSs as the runtime places them (``plan.layout``: round-robin). Per step, each worker computes for ``compute_s``:
the forward pass, then the backward pass (``backward_fraction`` of it), which makes the dense gradients ready in
the runtime's own buckets (:func:`bench.runtime.analyzer.gradient_buckets`, last weights first), each bucket once
backpropagation has produced its share of the gradient bytes; sparse gradients and state updates go when the
compute ends. Each bucket's gradients go to their variables' PSs as soon as it is ready. A PS, once a variable has
every worker's gradient (synchronous) or as each one comes (``asynchronous``), applies it (``apply_s_per_byte`` per
byte of each worker's gradient: CPU on its host) and sends the variable's new value to every worker (asynchronous:
to the worker whose gradient it applied) once that worker has sent all its updates of the step (the runtime's
worker posts the next step's receives only then: until it does, the PS's values wait); a worker starts its next
step once it has every variable's value. Compute itself occupies no host core (a GPU's work, or the replayed
compute of ``--compute replay``, which waits).

A transfer is, in order: the sender's host time (a core of its host: :meth:`TransferCost.host_s`), the per-message
latency, the wire (one egress queue at the sender's NIC and one ingress queue at the receiver's, each at the link
rate: full duplex, held for bytes / rate; with ``oversubscription`` > 1 it also holds one of the switch's
``servers / oversubscription`` lanes, its bisection), then the receiver's host time (a core of the receiver's
host). A worker's transfer to the PS on its own host crosses no NIC and has no latency: only both sides' host
time on that host (as the runtime does it, through shared memory). Each host's cores are a SimPy ``Resource`` of
``cores_per_host``; with ``shared_cores`` every host's work shares one pool of that many cores (all hosts emulated
on one machine, as ``--launcher netns`` runs are).

**What is merged, and why the answer does not change (much).** One worker's tensors of one bucket that go to one
PS are one transfer carrying their summed bytes and summed per-tensor host times (the latency once: they are
posted back to back, so their latencies overlap); the PS's answer for them (their new values) is one transfer the
same way, and their apply one CPU job. Within a group nothing else could have run in between on the same queues
in the same order, so the group's last tensor finishes when it would have; the earlier tensors of the group are
held back to the group's end (store and forward), which makes a step at most one group's pipelining slower. The
group's host time is not one core's, though: the transports post each tensor's send and receive as its own job
(the fabric transports' pool of 64 threads), so a host's cores take a group's tensors at once; a group's sender
and receiver time each run on as many cores as it has tensors (at most the host's, and as many as leave each
part at least its longest tensor's time). On one core per group instead, one server's step was its groups'
tensors one after another where N servers' were spread over N groups, and bench predict gave Inception-v3 over
grpc_rdma (paper compute, 100 Gb/s) a scaling efficiency of 1.25 at 8 servers (one server 2.93 s a step, of
2.19 s compute; now 2.30 s, and 0.997 to 1.001 from 2 to 16 servers).

**A transport that serves on one thread (grpc_rdma).** grpc_rdma has no pool of threads: one poller per process
takes every protocol message, and on it a sender copies a tensor into its staging buffer and writes it (a blocking
write, the wire's time) and a receiver copies each tensor out, one after another for every peer. So for the lines
of :data:`ONE_THREAD` a process's transfers hold its one thread (the sender's from its host time to the wire's end,
the receiver's for its host time), and their host time runs on one core. Measured (issue 62's note): VGG16 over
netns at 10 Gbit/s and 2 servers, buffered grpc_rdma's step was 1.5 s longer than direct mode's (the same
protocol without the copies) for 1.5 core-s more CPU a step, its copies wholly on the step's path; spread over the
cores, the prediction of that point was 76% over the measured throughput, 52% with the one thread.

**Worker classes (above :data:`CLASSES` servers).** Simulating every worker is ``servers x groups`` transfers a
step each way: 97,000 for Inception-v3 at 256 servers; SimPy runs about 19 events per transfer here (measured:
450,000 events, 4.7 s, for 8 workers of Inception at 256 servers), so every worker at 256 servers would be about
a minute per step, where the whole default grid (648 predictions) has 60 s. Data-parallel workers are alike (same
compute, same plan), so at most :data:`CLASSES` workers are simulated (fewer where ``classes x groups`` would pass
:data:`TRANSFER_BUDGET`), worker ``c`` standing for workers ``c, c + classes, ...``: each transfer it makes to
or from PS ``p`` is its own (both NICs, as any worker's) plus the class's other members' copies on the PS's side
only: their host time and apply on the PS's cores, their bytes on the PS's NIC (the members on other hosts than
the PS's). The members' own hosts (their NICs and cores) are not simulated: a PS host outside the simulated
workers' hosts carries only its PS's load. Its error against every worker simulated, on plans shaped like VGG16,
Inception-v3, FCN-5 and AlexNet at 16 and 32 servers, 100 Gb/s, zerocopy and grpc_tcp costs from a micro run of
this machine: -5.1% to +8.4%, 11 of 16 within 2.1% (issue 62's note). With ``shared_cores`` (a few emulated
hosts) every worker is simulated.

``step_s`` is the mean of the simulated steps after the first (:data:`WARMUP`; :data:`STEPS` steps, up to
:data:`MAX_STEPS` where a step is small (:data:`SMALL_STEP`): queues can settle into a cycle of a few
steps, which more steps average better), or, where it is
longer, the busiest resource's work a step (of those steps' transfers and applies) over its capacity: a short
simulation's transient can have a step shorter than that (part of a step's work done in the step before), a steady
state cannot.

**A faster link never predicts a slower step (:func:`simulate_rates`).** The queues serve first come first served
(an earlier step's work first): a host's cores, as an OS runs ready threads, and a NIC's queues. That is not
monotone in the link rate: a faster link changes the order work reaches a host's cores, and greedy scheduling
without preemption can then leave a core idle that the slower order kept busy (Graham's anomalies). Measured (issue
62's note): 18 of 120 random small cases were slower at twice the rate, by up to 4.5%, and 8 of the default grid's
432 pairs of rates (a rate and the next faster), by up to 8.6%. It is not the measurement alone (a mean cut short of
a cycle of steps, the smallest case's cause): with the mean over a whole detected cycle, 14 of 300 random cases stay
slower. Neither a static priority (tried: Graham's anomalies are of priority lists) nor processor sharing is
monotone in general; a fixed order on every queue is (each event time a max of sums of durations), but one order for
every rate (an infinite link's, replayed) made a core wait for work the order put first though other work was ready:
+11% a step in the median of 150 random cases, up to twice. So each rate keeps its own first-come schedule, and
:func:`simulate_rates`, predicting several rates of one cluster together, gives each rate the faster of its own
schedule and the next slower rate's prediction: a faster link can carry the slower rate's schedule unchanged (each
transfer paced to the slower rate, as a NIC's rate limiter does), so that step is one the faster link can run. It
costs nothing (no simulation more) and changes a prediction only where the anomaly would have: 9 of the default
grid's 648 (a change carries on to the next faster rate), by up to 8.6%, at 26.7 s for the grid's simulations here,
26.0 s each rate alone; such a prediction is the slower rate's (its fractions and utilisations, its NIC held for the
slower rate's time).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from itertools import pairwise

import simpy

from bench.experiments.predict.costs import TransferCost
from bench.results.lines import GRPC_RDMA
from bench.runtime.analyzer import Plan, gradient_buckets

#: the lines whose every transfer of a process is served by one thread (see the module), with their modes
#: (``grpc_rdma:direct``)
ONE_THREAD = (GRPC_RDMA,)
#: the SGD update's CPU cost per gradient byte when none is measured: ``w -= lr * g`` on float32 with NumPy,
#: measured at about 0.2 ns per byte (16 MB tensors, this 2-core machine, 2026-11)
APPLY_S_PER_BYTE = 0.2e-9
#: steps simulated, and the first ones left out of the mean (the pipeline filling)
STEPS = 3
MAX_STEPS = 9
#: a step of at most this many transfers each way is small: up to :data:`MAX_STEPS` of it are simulated
SMALL_STEP = 192
WARMUP = 1
#: workers simulated: up to this many servers every one; above it, each stands for a class (see the module)
CLASSES = 8
#: ... and fewer where a step would have more than this many transfers each way (``classes x groups``), to keep
#: the whole default grid under a minute
TRANSFER_BUDGET = 512


@dataclass(frozen=True)
class Cluster:
    """The cluster a step is predicted for: ``servers`` hosts with one NIC of ``link_rate_bps`` (bits per second;
    None: an infinite link) and ``cores_per_host`` cores each, a switch ``oversubscription`` (1.0: non-blocking),
    or every host's work on one pool of ``shared_cores`` cores (hosts emulated on one machine)."""

    servers: int
    link_rate_bps: float | None = None
    cores_per_host: int = 8
    oversubscription: float = 1.0
    shared_cores: int | None = None

    def __post_init__(self) -> None:
        if self.servers < 1:
            raise ValueError(f"a cluster needs at least one server, not {self.servers}")
        if self.link_rate_bps is not None and self.link_rate_bps <= 0:
            raise ValueError(f"link rate {self.link_rate_bps} is not positive; give bits per second, or None")
        if self.cores_per_host < 1 or (self.shared_cores is not None and self.shared_cores < 1):
            raise ValueError("a host needs at least one core")
        if self.oversubscription < 1:
            raise ValueError(f"oversubscription {self.oversubscription} is below 1 (1.0: a non-blocking switch)")


@dataclass(frozen=True)
class StepPrediction:
    """A predicted step and what it rests on.

    ``fractions``: per worker, the parts of a step that are ``compute``, ``host`` (its host's CPU working for its
    transfers while it does not compute), ``wire`` (its NIC moving its tensors, neither of those) and ``waiting``
    (the rest: for a PS, another worker, the latency); they sum to 1. ``saturated`` is the busiest resource
    (``nic:egress:<host>``, ``nic:ingress:<host>``, ``cpu:<host>``, ``cpu:shared``, ``switch``) and
    ``utilisation`` its busy share of the step; ``nic_bytes[host]`` the bytes its NIC sent and received per step.
    """

    step_s: float
    steps: tuple[float, ...]
    fractions: tuple[dict[str, float], ...]
    saturated: str
    utilisation: float
    utilisations: dict[str, float] = field(repr=False)
    nic_bytes: dict[int, tuple[int, int]] = field(repr=False)
    #: the workers simulated, each standing for every ``classes``-th one (= servers: every worker; see the module)
    classes: int = 1

    @property
    def steps_per_s(self) -> float:
        return 1.0 / self.step_s if self.step_s > 0 else float("inf")


@dataclass(frozen=True)
class _Group:
    """Tensors of one variable group between a worker and one PS: a bucket's gradients and the values back."""

    ps: int
    up: tuple[int, ...]  # bytes of each tensor a worker sends
    down: tuple[int, ...]  # bytes of each value the PS sends back
    apply_bytes: int  # trainable gradient bytes the PS applies per worker


def _groups(plan: Plan) -> tuple[list[tuple[float, list[_Group]]], int]:
    """The step's sends of one worker, in order: (the fraction of the backward pass done when they are ready, their
    groups), the last with fraction 2.0: after the compute (sparse gradients, state); and the number of groups (the
    values a worker waits for)."""
    servers = plan.servers
    worker0 = plan.layout.worker(0)
    up: dict[int, list[int]] = defaultdict(list)
    for t in plan.transfers:
        if t.src == worker0:
            up[int(t.name[1:].split(".")[0])].append(t.nbytes or 0)
    trainable = plan.trainable
    dense = [None if v.sparse else v.nbytes for v in trainable]
    total = sum(b for b in dense if b) or 1
    schedule: list[tuple[float, list[_Group]]] = []
    done = 0
    count = 0

    def grouped(variables: list) -> list[_Group]:
        by_ps: dict[int, list] = defaultdict(list)
        for v in variables:
            by_ps[v.index % servers].append(v)
        return [_Group(ps, tuple(b for v in vs for b in up[v.index]), tuple(v.nbytes for v in vs),
                       sum(sum(up[v.index]) for v in vs if v.trainable)) for ps, vs in sorted(by_ps.items())]

    for bucket in gradient_buckets(dense):
        done += sum(dense[i] or 0 for i in bucket)
        groups = grouped([trainable[i] for i in bucket])
        count += len(groups)
        schedule.append((done / total, groups))
    after = grouped([v for v in plan.variables if v.sparse or not v.trainable])
    count += len(after)
    schedule.append((2.0, after))
    return schedule, count


class _Cores:
    """A host's cores: a job takes some of them at once, waiting jobs go in order of their step (an earlier step's
    work first, then first come first served), the first waiting one before any later one."""

    def __init__(self, env: simpy.Environment, cores: int) -> None:
        self.env, self.free, self.capacity = env, cores, cores
        self.waiting: list[tuple[int, int, int, simpy.Event]] = []
        self.count = 0

    def get(self, cores: int, step: int) -> simpy.Event:
        event = self.env.event()
        self.count += 1
        heapq.heappush(self.waiting, (step, self.count, cores, event))
        self._grant()
        return event

    def put(self, cores: int) -> None:
        self.free += cores
        self._grant()

    def _grant(self) -> None:
        while self.waiting and self.waiting[0][2] <= self.free:
            _, _, cores, event = heapq.heappop(self.waiting)
            self.free -= cores
            event.succeed()


class _Sim:
    """One simulation: the resources, the processes and what they record."""

    def __init__(self, plan: Plan, cost: TransferCost, cluster: Cluster, compute_s: float, backward_fraction: float,
                 apply_s_per_byte: float, asynchronous: bool, classes: int) -> None:
        self.env = simpy.Environment()
        self.plan, self.cost, self.cluster = plan, cost, cluster
        self.compute_s, self.backward_fraction = compute_s, backward_fraction
        self.apply_s_per_byte, self.asynchronous = apply_s_per_byte, asynchronous
        self.exact = classes >= cluster.servers
        servers = cluster.servers
        env = self.env
        if cluster.shared_cores is not None:
            pool = _Cores(env, cluster.shared_cores)
            self.cpu = [pool] * servers
            self.cpu_names = ["cpu:shared"] * servers
            self.cores = cluster.shared_cores
        else:
            self.cpu = [_Cores(env, cluster.cores_per_host) for _ in range(servers)]
            self.cpu_names = [f"cpu:{h}" for h in range(servers)]
            self.cores = cluster.cores_per_host
        self.egress = [simpy.PriorityResource(env, capacity=1) for _ in range(servers)]
        self.ingress = [simpy.PriorityResource(env, capacity=1) for _ in range(servers)]
        lanes = int(servers / cluster.oversubscription) if cluster.oversubscription > 1 else 0
        self.switch = simpy.PriorityResource(env, capacity=max(1, lanes)) if lanes else None
        #: per (host, is the PS's): the one thread that serves every transfer of that process (:data:`ONE_THREAD`)
        one_thread = cost.transport.partition(":")[0] in ONE_THREAD
        self.threads = {(h, ps): simpy.PriorityResource(env, capacity=1)
                        for h in range(servers) for ps in (False, True)} if one_thread else {}
        self.schedule, self.group_count = _groups(plan)
        #: per group: (sender, receiver, cores at once) host time of the gradients up and of the values down
        self.group_costs = {id(g): (_host(cost, g.up), _host(cost, g.down)) for _, gs in self.schedule for g in gs}
        #: the simulated workers, one per class: worker c stands for workers c, c + classes, ... (see the module)
        self.workers = list(range(min(classes, servers)))
        self.members = {c: len(range(c, servers, len(self.workers))) for c in self.workers}
        transfers = max(1, len(self.workers) * self.group_count)
        self.steps = max(STEPS, min(MAX_STEPS, SMALL_STEP // transfers))
        self.starts: dict[int, list[float]] = {w: [] for w in self.workers}
        self.pending: dict[tuple[int, int], int] = {}
        self.done: dict[tuple[int, int], simpy.Event] = {}
        #: per (worker, step): its updates not yet sent, and the event of the last one sent
        self.unsent: dict[tuple[int, int], int] = {}
        self.sent: dict[tuple[int, int], simpy.Event] = {}
        self.arrived: dict[tuple[int, int, int], int] = defaultdict(int)
        self.nic_bytes: dict[int, list[int]] = {h: [0, 0] for h in range(servers)}
        #: per resource, the work (seconds x units held) of the measured steps' transfers and applies
        self.busy: dict[str, float] = defaultdict(float)
        self.intervals: dict[int, dict[str, list[tuple[float, float]]]] = {
            w: {"compute": [], "host": [], "wire": []} for w in self.workers}

    # -- resources ---------------------------------------------------------------------------------

    def _account(self, name: str, step: int, work: float) -> None:
        if step >= WARMUP:
            self.busy[name] += work

    def cpu_work(self, host: int, seconds: float, copies: int, worker: int | None, step: int, threads: int = 0):
        """``copies`` jobs of ``seconds`` each on ``host``'s cores: as many at once as there are cores (and
        ``threads``, when not 0) (one request for all of them: a lumped job takes its share of the cores at once)."""
        if seconds <= 0:
            return
        cores = max(1, min(copies, self.cores, threads or self.cores))
        duration = seconds * copies / cores
        pool = self.cpu[host]
        yield pool.get(cores, step)
        start = self.env.now
        yield self.env.timeout(duration)
        pool.put(cores)
        self._account(self.cpu_names[host], step, duration * cores)
        if worker is not None:
            self.intervals[worker]["host"].append((start, start + duration))

    def wire(self, src: int, dst: int, out_bytes: int, in_bytes: int, worker: int | None, step: int):
        """Hold ``src``'s egress for ``out_bytes`` and ``dst``'s ingress for ``in_bytes`` at the link rate (and a
        switch lane while either is held, with oversubscription)."""
        if step >= WARMUP:
            self.nic_bytes[src][0] += out_bytes
            self.nic_bytes[dst][1] += in_bytes
        rate = self.cluster.link_rate_bps
        if rate is None or out_bytes + in_bytes == 0:
            return
        out_s, in_s = out_bytes * 8 / rate, in_bytes * 8 / rate
        held = []
        if out_s > 0:
            held.append((self.egress[src], out_s, f"nic:egress:{src}"))
        if in_s > 0:
            held.append((self.ingress[dst], in_s, f"nic:ingress:{dst}"))
        if self.switch is not None:
            held.append((self.switch, max(out_s, in_s), "switch"))
        requests = []
        for resource, seconds, name in held:  # one at a time, always egress, ingress, switch: no deadlock
            request = resource.request(priority=step)
            yield request
            requests.append((request, seconds, name))
        start = self.env.now
        elapsed = 0.0
        for request, seconds, name in sorted(requests, key=lambda r: r[1]):
            if seconds > elapsed:
                yield self.env.timeout(seconds - elapsed)
                elapsed = seconds
            request.resource.release(request)
            self._account(name, step, seconds)
        if worker is not None:
            self.intervals[worker]["wire"].append((start, start + elapsed))

    # -- the step ----------------------------------------------------------------------------------

    def transfer(self, src: int, dst: int, host_s: tuple[float, float, int], nbytes: int, src_copies: int,
                 dst_copies: int, worker: int, worker_sends: bool, step: int):
        """A (merged) transfer of ``nbytes`` from host ``src`` to ``dst`` costing ``host_s`` (sender, receiver):
        sender host time (``src_copies`` of it), then latency and wire unless local, then receiver host time
        (``dst_copies``), each spread over up to ``host_s[2]`` cores. In representative mode the PS's side also
        moves the other workers' copies (its host NIC only: their hosts' NICs are not simulated)."""
        sender, receiver, parts = host_s
        threads = 1 if self.threads else 0  # on one thread of each process (ONE_THREAD), or on its cores
        parts = 1 if threads else parts
        thread = yield from self._thread(src, not worker_sends, step)
        yield from self.cpu_work(src, sender / parts, src_copies * parts, worker if worker_sends else None, step,
                                 threads)
        local = src == dst
        ps = dst if worker_sends else src
        # the class's other workers' copies that cross the PS's NIC: its members less the simulated one and
        # less the one on the PS's own host (if the PS's host is in the class)
        in_class = ps % len(self.workers) == worker
        others = (self.members[worker] - 1 - (1 if in_class and not local else 0)) * nbytes
        if not local or others:
            if self.cost.latency_s > 0:
                yield self.env.timeout(self.cost.latency_s)
            lump = None
            if others:  # beside the simulated worker's own copy, on the PS's NIC only
                out, into = (0, others) if worker_sends else (others, 0)
                lump = self.env.process(self.wire(ps, ps, out, into, None, step))
            if not local:
                yield from self.wire(src, dst, nbytes, nbytes, worker, step)
            if lump is not None:
                yield lump
        self._release(thread)
        thread = yield from self._thread(dst, worker_sends, step)
        yield from self.cpu_work(dst, receiver / parts, dst_copies * parts, None if worker_sends else worker, step,
                                 threads)
        self._release(thread)

    def _thread(self, host: int, ps: bool, step: int):
        """The one thread of ``host``'s PS (or worker) that serves its transfers, once it is free (a SimPy
        request: give it back with :meth:`_release`); None where each transfer has a thread of its own."""
        if not self.threads:
            return None
        request = self.threads[(host, ps)].request(priority=step)
        yield request
        return request

    def _release(self, request) -> None:
        if request is not None:
            request.resource.release(request)

    def send_gradients(self, worker: int, group: _Group, step: int):
        costs = self.group_costs[id(group)]
        members = self.members[worker]
        yield from self.transfer(worker, group.ps, costs[0], sum(group.up), 1, members, worker, True,
                                 step)
        posted = (worker, step)
        self.unsent[posted] -= 1
        if self.unsent[posted] == 0:
            self.sent[posted].succeed()
        key = (group.ps, id(group), step)
        self.arrived[key] += members
        if self.asynchronous or self.arrived[key] >= self.cluster.servers:
            applied = members if self.asynchronous else self.cluster.servers  # one apply per worker's gradient
            yield from self.cpu_work(group.ps, self.apply_s_per_byte * group.apply_bytes, applied, None, step)
            for target in [worker] if self.asynchronous else self.workers:
                self.env.process(self.send_values(target, group, step))

    def send_values(self, worker: int, group: _Group, step: int):
        costs = self.group_costs[id(group)]
        # the worker asks for the next step's values once all its updates of this step are sent (the runtime's
        # worker posts its receives at the start of a step, after the last step's sends are done): until then the
        # PS's values wait (grpc's parked in its rendezvous, zerocopy's for the receiver's buffer)
        yield self.sent[(worker, step)]
        yield from self.transfer(group.ps, worker, costs[1], sum(group.down), self.members[worker], 1, worker,
                                 False, step)
        key = (worker, step)
        self.pending[key] -= 1
        if self.pending[key] == 0:
            self.done[key].succeed()

    def run_worker(self, worker: int):
        env = self.env
        forward = self.compute_s * (1 - self.backward_fraction)
        for step in range(self.steps):
            start = env.now
            self.starts[worker].append(start)
            key = (worker, step)
            self.pending[key] = self.unsent[key] = self.group_count
            self.done[key], self.sent[key] = env.event(), env.event()
            self.intervals[worker]["compute"].append((start, start + self.compute_s))
            for fraction, groups in self.schedule:
                ready = start + (self.compute_s if fraction > 1 else forward + self.backward_fraction
                                 * self.compute_s * fraction)
                if ready > env.now:
                    yield env.timeout(ready - env.now)
                for group in groups:
                    env.process(self.send_gradients(worker, group, step))
            if self.group_count == 0:
                self.done[key].succeed()
                self.sent[key].succeed()
            yield self.done[key]
        self.starts[worker].append(env.now)

    def run(self) -> StepPrediction:
        for worker in self.workers:
            self.env.process(self.run_worker(worker))
        self.env.run()
        stalled = [w for w in self.workers if len(self.starts[w]) <= self.steps]
        if stalled:  # every event ran and a worker still waits: a queue never granted (a bug in this model)
            raise RuntimeError(f"the simulation stalled: worker(s) {stalled} never finished step "
                               f"{len(self.starts[stalled[0]]) - 1}")
        ends = [max(self.starts[w][k] for w in self.workers) for k in range(self.steps + 1)]
        steps = tuple(b - a for a, b in pairwise(ends))
        measured = steps[WARMUP:]
        window = (ends[WARMUP], ends[self.steps])
        fractions = [_fractions(self.intervals[w], window) for w in self.workers]
        fractions = [fractions[w % len(self.workers)] for w in range(self.cluster.servers)]
        measured_steps = self.steps - WARMUP
        # per resource, its measured steps' work a step over its capacity: no steady state is shorter, though a
        # step of a short simulation's transient can be (work of a step done in the one before it)
        bounds = {}
        for name, work in self.busy.items():
            capacity = self.cores if name.startswith("cpu") else (self.switch.capacity if name == "switch" else 1)
            bounds[name] = work / measured_steps / capacity
        step_s = max(sum(measured) / len(measured), max(bounds.values(), default=0.0))
        utilisations = {name: bound / step_s if step_s > 0 else 0.0 for name, bound in bounds.items()}
        saturated = max(utilisations, key=lambda n: utilisations[n]) if utilisations else "none"
        if self.exact:
            nic = {h: (e // measured_steps, i // measured_steps) for h, (e, i) in self.nic_bytes.items()}
        else:
            nic = nic_bytes(self.plan)
        return StepPrediction(step_s, steps, tuple(fractions), saturated, utilisations.get(saturated, 0.0),
                              utilisations, nic, len(self.workers))


def _host(cost: TransferCost, sizes: tuple[int, ...]) -> tuple[float, float, int]:
    """The summed sender and receiver host time of tensors of ``sizes``, and on how many cores at once they can
    run: one per tensor, as many as leave each at least the longest tensor's time (see the module)."""
    times = [cost.host_s(b) for b in sizes]
    total = [a + b for a, b in times]
    longest = max(total, default=0.0)
    parts = max(1, min(len(times), int(sum(total) / longest))) if longest > 0 else 1
    return sum(t[0] for t in times), sum(t[1] for t in times), parts


def _measure(intervals: list[tuple[float, float]], window: tuple[float, float]) -> float:
    """The length of the union of ``intervals`` within ``window``."""
    total, end = 0.0, window[0]
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, window[1])
        if b > a:
            total += b - a
            end = b
    return total


def _fractions(intervals: dict[str, list[tuple[float, float]]], window: tuple[float, float]) -> dict[str, float]:
    span = window[1] - window[0]
    if span <= 0:
        return {"compute": 1.0, "host": 0.0, "wire": 0.0, "waiting": 0.0}
    compute = _measure(intervals["compute"], window)
    host = _measure(intervals["compute"] + intervals["host"], window)
    wire = _measure(intervals["compute"] + intervals["host"] + intervals["wire"], window)
    return {"compute": compute / span, "host": (host - compute) / span, "wire": (wire - host) / span,
            "waiting": (span - wire) / span}


def nic_bytes(plan: Plan) -> dict[int, tuple[int, int]]:
    """The bytes each host's NIC sends and receives per step by the plan's placement: every worker's tensors to
    and from the PSs on other hosts (a worker's tensors to or from the PS on its own host cross no NIC)."""
    servers = plan.servers
    schedule, _ = _groups(plan)
    up_on, down_on = [0] * servers, [0] * servers
    for _, groups in schedule:
        for g in groups:
            up_on[g.ps] += sum(g.up)
            down_on[g.ps] += sum(g.down)
    up, down = sum(up_on), sum(down_on)
    return {h: (up - up_on[h] + (servers - 1) * down_on[h], down - down_on[h] + (servers - 1) * up_on[h])
            for h in range(servers)}


def simulate(plan: Plan, cost: TransferCost, cluster: Cluster, compute_s: float, backward_fraction: float = 2 / 3,
             apply_s_per_byte: float = APPLY_S_PER_BYTE, asynchronous: bool = False,
             classes: int | None = None) -> StepPrediction:
    """Predict one step of ``plan`` (its variables and placement; its server count must be the cluster's) over a
    transport costing ``cost`` on ``cluster``, for a worker computing ``compute_s`` a step (``backward_fraction``
    of it the backward pass). ``classes`` workers are simulated, each standing for every ``classes``-th worker
    (default :data:`CLASSES`; every worker with shared cores); see the module. Several link rates of one cluster:
    :func:`simulate_rates` (a faster link never slower)."""
    if plan.servers != cluster.servers:
        raise ValueError(f"the plan is for {plan.servers} server(s), the cluster has {cluster.servers}; analyse "
                         f"the model for {cluster.servers}")
    if compute_s < 0 or not 0 <= backward_fraction <= 1:
        raise ValueError(f"compute {compute_s} s with backward fraction {backward_fraction}: give compute >= 0 "
                         f"and a fraction in [0, 1]")
    if classes is None:
        groups = _groups(plan)[1]
        classes = cluster.servers if cluster.shared_cores is not None else \
            max(1, min(CLASSES, TRANSFER_BUDGET // max(1, groups)))
    if classes < 1:
        raise ValueError(f"classes {classes}: simulate at least one worker")
    return _Sim(plan, cost, cluster, compute_s, backward_fraction, apply_s_per_byte, asynchronous,
                min(classes, cluster.servers)).run()


def simulate_rates(plan: Plan, cost: TransferCost, cluster: Cluster, rates: Iterable[float | None], compute_s: float,
                   backward_fraction: float = 2 / 3, apply_s_per_byte: float = APPLY_S_PER_BYTE,
                   asynchronous: bool = False, classes: int | None = None) -> dict[float | None, StepPrediction]:
    """:func:`simulate` at each of ``rates`` (bits per second; None: an infinite link; ``cluster``'s own rate is
    not used), where a faster link never predicts a slower step: each rate's prediction is the faster of its own
    schedule and the next slower rate's prediction, which a faster link can carry paced (see the module)."""
    predictions: dict[float | None, StepPrediction] = {}
    slower: StepPrediction | None = None
    for rate in sorted(set(rates), key=lambda r: float("inf") if r is None else r):
        own = simulate(plan, cost, replace(cluster, link_rate_bps=rate), compute_s, backward_fraction,
                       apply_s_per_byte, asynchronous, classes)
        slower = own if slower is None or own.step_s <= slower.step_s else slower
        predictions[rate] = slower
    return predictions

