"""``bench converge``: how long each transport takes to train to a target on real data (the paper's Figure 10).

Transports change how long training takes, not what it learns: with the same seed every transport
runs the same synchronous SGD over the same batches, so the training loss at every step is the same
(the records show it; a test checks it), and only the wall-clock time to reach a held-out target
differs. The paper's Figure 10 plots loss against time for a CNN on CIFAR-10 and a Seq2Seq model:
zero copy reaches the same loss about 2.6x (CIFAR) and 3x (Seq2Seq) sooner than gRPC over TCP.

Records (experiment ``converge``), by ``kind``:

- ``step``: every step's training loss (the mean over the workers' batches) and the wall-clock seconds
  at its start;
- ``eval``: each evaluation point (every ``--eval-every`` steps and the last): held-out loss and the
  task's metric (accuracy, or perplexity) on the weights of that step;
- ``summary``: per transport, the first evaluation that reached ``--target``: its step and seconds,
  and the time's ratio to grpc_tcp's (how many times sooner the transport got there).

Wall-clock seconds run from the first step's start on worker 0 and leave out the time spent
evaluating (evaluation is the benchmark's, not the training's).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.ground.paper import CONVERGE_SPEEDUP
from bench.results import ConvergeRecord, DiskError
from bench.results.lines import GRPC_TCP, ZERO_COPY

#: transport whose time to target every other is compared with (the paper's baseline)
BASELINE = GRPC_TCP


def paper_speedup(task: str) -> float | None:
    """Zero copy's time-to-target advantage over gRPC.TCP in the paper's Figure 10 (``bench.ground.paper``), by task."""
    claim = CONVERGE_SPEEDUP.get((task, BASELINE))
    return claim.low if claim else None


#: per metric: whether a higher value is better
HIGHER_IS_BETTER = {"accuracy": True, "perplexity": False, "heldout_loss": False}


@dataclass(frozen=True)
class Target:
    """``metric`` reaching ``value`` (accuracy at least, perplexity or loss at most)."""

    metric: str
    value: float

    def reached(self, measured: float) -> bool:
        if measured is None or math.isnan(measured):
            return False
        return measured >= self.value if HIGHER_IS_BETTER[self.metric] else measured <= self.value

    def __str__(self) -> str:
        return f"{self.metric}={self.value:g}"


def parse_target(text: str) -> Target:
    """``accuracy=0.97``, ``perplexity=8`` or ``heldout_loss=0.5``; ValueError saying what is wrong."""
    metric, sep, value = text.partition("=")
    metric = metric.strip()
    if not sep or metric not in HIGHER_IS_BETTER:
        raise ValueError(f"'{text}' is not METRIC=VALUE with METRIC one of {', '.join(HIGHER_IS_BETTER)}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"'{text}': '{value}' is not a number") from None
    if not math.isfinite(number) or number < 0 or (metric == "accuracy" and number > 1):
        raise ValueError(f"'{text}': {metric} must be a finite number >= 0" + (" and <= 1" if metric == "accuracy"
                                                                                else ""))
    return Target(metric, number)


def target_problem(target: Target, task: str, metric: str) -> str | None:
    """Why ``--target`` can never be reached by ``task``, whose evaluations report ``metric`` (accuracy or
    perplexity) and the held-out loss: it names a metric the task does not report. None when it can be."""
    takes = (metric, "heldout_loss")
    if target.metric in takes:
        return None
    return (f"--target {target}: the {task} task reports {' and '.join(takes)}, never {target.metric}, so the target "
            f"could not be reached; give --target {metric}=VALUE or heldout_loss=VALUE")


def step_records(common: dict[str, Any], losses: dict[int, dict[int, float]],
                 starts: dict[int, float]) -> list[ConvergeRecord]:
    """One ``step`` record per step: the mean of the workers' losses (``losses[step][server]``)."""
    return [ConvergeRecord(**common, kind="step", step=step, wall_s=starts.get(step),
                           train_loss=sum(by_server.values()) / len(by_server))
            for step, by_server in sorted(losses.items())]


def eval_records(common: dict[str, Any], evals: list[dict[str, Any]], metric: str,
                 losses: dict[int, dict[int, float]]) -> list[ConvergeRecord]:
    """One ``eval`` record per evaluation point."""
    rows = []
    for point in sorted(evals, key=lambda p: p["step"]):
        by_server = losses.get(point["step"], {})
        rows.append(ConvergeRecord(**common, kind="eval", step=point["step"], wall_s=point["wall_s"],
                                   train_loss=sum(by_server.values()) / len(by_server) if by_server else None,
                                   heldout_loss=point["heldout_loss"], metric=metric, metric_value=point[metric]))
    return rows


def summary_records(evaluations: list[ConvergeRecord | dict[str, Any]], target: Target) -> list[ConvergeRecord]:
    """Per transport, the first evaluation that reached ``target``, and its time's ratio to the baseline's."""
    evaluations = [row if isinstance(row, ConvergeRecord) else ConvergeRecord.from_row(row) for row in evaluations]
    first: dict[str, ConvergeRecord | None] = {}
    for row in sorted(evaluations, key=lambda r: r.step):  # stable: transports stay in the order run
        first.setdefault(row.transport, None)
        measured = row.heldout_loss if target.metric == "heldout_loss" else row.metric_value
        if first[row.transport] is None and (row.metric == target.metric or target.metric == "heldout_loss") \
                and target.reached(measured):
            first[row.transport] = row
    baseline = first.get(BASELINE)
    rows = []
    for label, row in first.items():
        template = next(r for r in evaluations if r.transport == label)
        seconds = row.wall_s if row else None
        rows.append(ConvergeRecord(
            kind="summary", transport=label, task=template.task, batch_size=template.batch_size,
            servers=template.servers, learning_rate=template.learning_rate, fabric=template.fabric,
            framework=template.framework, framework_version=template.framework_version, target=str(target),
            steps_to_target=row.step if row else None, time_to_target_s=seconds,
            speedup_vs_grpc_tcp=(baseline.wall_s / seconds) if (row and baseline and seconds) else None,
            paper_speedup_vs_grpc_tcp=paper_speedup(template.task) if label == ZERO_COPY else None))
    return rows


def losses_agree(losses: dict[str, list[float]], rtol: float = 1e-6) -> dict[str, float]:
    """The largest relative difference of each transport's per-step losses from the first transport's."""
    labels = list(losses)
    if not labels:
        return {}
    reference = losses[labels[0]]
    worst = {}
    for label in labels[1:]:
        steps = min(len(reference), len(losses[label]))
        worst[label] = max((abs(a - b) / max(abs(a), 1e-12) for a, b in zip(reference[:steps], losses[label][:steps],
                                                                            strict=True)), default=0.0)
    return worst


# -- running it --------------------------------------------------------------------------------------------


@dataclass
class Progress:
    """What the ranks of one transport's run reported as they went: losses per step and server, evaluations."""

    losses: dict[int, dict[int, float]]
    starts: dict[int, float]
    evals: list[dict[str, Any]]
    #: the fabric a worker described (``Transport.describe``), once the run is over
    fabric: dict[str, Any] | None = None

    @classmethod
    def empty(cls) -> Progress:
        return cls({}, {}, [])

    def take(self, payload: Any) -> str | None:
        """Keep a report (``("loss", server, step, loss, wall_s)`` or ``("eval", point)``); a line for the bar."""
        if payload[0] == "loss":
            _, server, step, loss, wall_s = payload
            self.losses.setdefault(step, {})[server] = loss
            if server == 0:
                self.starts[step] = wall_s
            return f"step {step} loss {loss:.4f}"
        if payload[0] == "eval":
            self.evals.append(payload[1])
        return None

    def ordered_losses(self) -> list[float]:
        return [sum(v.values()) / len(v) for _, v in sorted(self.losses.items())]


def run_task(config, launcher, bar) -> Progress:
    """One transport's training run (``config``: a ``TrainConfig`` of a task); what its ranks reported."""
    from bench.experiments.training import train

    progress = Progress.empty()

    def on_progress(payload: Any) -> None:
        line = progress.take(payload)
        if line is not None and payload[1] == 0:
            bar.update(1)
            bar.set_postfix_str(line)

    outcome = train(config, launcher, on_progress=on_progress)["outcome"]
    progress.fabric = next((times.extra.get("fabric") for role, times in outcome.values() if role == "worker"), None)
    return progress


def converge(args, launcher, writer, chosen: list, task, target: Target | None,
             options_for: Callable[[Any], dict[str, Any]]) -> tuple[list[str], dict[str, list[float]]]:
    """Train ``task`` over every transport of ``chosen`` (``bench.options.Choice``; ``options_for(choice)``: its
    constructor options); records go to ``writer``. Returns the failures and each transport's loss per step."""
    import dataclasses

    from tqdm import tqdm

    from bench.experiments.tasks import task_workload
    from bench.experiments.training import TrainingError
    from bench.launch import LaunchError
    from bench.runtime.config import TrainConfig
    from bench.runtime.framework import DEFAULT_FRAMEWORK, framework_named
    from transports import fabric

    failures: list[str] = []
    evaluations: list[dict[str, Any]] = []
    losses: dict[str, list[float]] = {}
    framework = getattr(args, "framework", DEFAULT_FRAMEWORK)
    for choice in chosen:
        label = choice.label
        workload = task_workload(task.name, args.data, framework)
        config = TrainConfig(model=task.name, workload=workload, transport=choice.name,
                             transport_options={}, batch_size=args.batch_size, servers=args.servers, steps=args.steps,
                             warmup=0, learning_rate=args.learning_rate, seed=args.seed, timeout_s=args.timeout,
                             label=label, evaluate_every=args.eval_every, time_s=args.time)
        config = dataclasses.replace(config, transport_options=options_for(choice))
        common = {"transport": label, "task": task.name, "batch_size": args.batch_size, "servers": args.servers,
                  "learning_rate": args.learning_rate, "framework": framework,
                  "framework_version": framework_named(framework).version()}
        with tqdm(total=args.steps, unit="step", desc=f"{task.name} over {label}", dynamic_ncols=True,
                  disable=None) as bar:
            try:
                progress = run_task(config, launcher, bar)
            except (LaunchError, TrainingError, ValueError, RuntimeError) as exc:
                failures.append(f"{label}: {exc}")
                bar.write(f"bench converge: error: {task.name} over {label}: {exc}", file=sys.stderr)
                continue
        common["fabric"] = fabric.label(progress.fabric)
        try:
            for row in step_records(common, progress.losses, progress.starts):
                writer.add(row)
            points = eval_records(common, progress.evals, task.metric, progress.losses)
            for row in points:
                writer.add(row)
        except DiskError as exc:  # a full or failing disk: stop; the transports recorded before stay
            failures.append(str(exc))
            print(f"bench converge: error: {exc} (the transports recorded before are in {writer.path})",
                  file=sys.stderr)
            return failures, losses
        evaluations += points
        losses[label] = progress.ordered_losses()
        last = points[-1] if points else None
        if last is not None:
            print(f"{label:18} {len(losses[label]):5} steps in {last.wall_s:7.1f} s: held-out {task.metric} "
                  f"{last.metric_value:.4g}, loss {last.heldout_loss:.4f}")
    if target is not None and evaluations:
        try:
            for row in summary_records(evaluations, target):
                writer.add(row)
        except DiskError as exc:
            failures.append(str(exc))
            print(f"bench converge: error: {exc} (the transports' records are in {writer.path})", file=sys.stderr)
    return failures, losses
