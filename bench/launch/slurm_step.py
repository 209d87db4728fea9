"""Who a task of a Slurm step is, as Slurm's variables say (:class:`SlurmStep`), and Slurm's compressed host list
syntax (:func:`expand_hostlist`: ``node[01-03,7]``) that names the step's nodes."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product

from bench.launch.messages import LaunchError


class SlurmEnvironmentError(LaunchError):
    """Slurm's variables are missing or do not agree; the message names the variable."""


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list (``node[01-03,7],gpu-a[1-2]b``) as host names, in order."""
    names: list[str] = []
    for item in _split_top(text.strip()):
        if not item:
            raise ValueError(f"an empty host name in {text!r}")
        parts = re.split(r"(\[[^\]]*\])", item)
        choices: list[list[str]] = []
        for part in parts:
            if part.startswith("["):
                choices.append(_expand_range(part[1:-1], text))
            elif "[" in part or "]" in part:
                raise ValueError(f"unbalanced brackets in {text!r}")
            else:
                choices.append([part])
        names += ["".join(combo) for combo in product(*choices)]
    return names


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char == "["
        depth -= char == "]"
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced brackets in {text!r}")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in {text!r}")
    items.append(text[start:])
    return items


def _expand_range(spec: str, text: str) -> list[str]:
    """``01-03,7`` -> 01 02 03 7: a range keeps its lower bound's zero padding."""
    out = []
    for piece in spec.split(","):
        low, dash, high = piece.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{piece!r} is not a number or a range in {text!r}")
        if not dash:
            out.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"the range {piece!r} runs backwards in {text!r}")
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


@dataclass(frozen=True)
class SlurmStep:
    """This task of a Slurm step, as Slurm's variables say."""

    job_id: str
    step_id: str
    #: this task's number in the step (0 coordinates) and the step's number of tasks
    task: int
    tasks: int
    #: the step's nodes, in Slurm's order, and the one this task runs on
    nodes: tuple[str, ...]
    node: str

    @classmethod
    def from_environment(cls, env: Mapping[str, str]) -> SlurmStep:
        """The step from ``env``; a missing or inconsistent variable raises one line naming it."""

        def need(*names: str) -> tuple[str, str]:
            for name in names:
                if env.get(name, "").strip():
                    return name, env[name].strip()
            alternatives = " or ".join(names)
            raise SlurmEnvironmentError(
                f"{alternatives} is not set: --launcher slurm runs in the tasks of a Slurm step "
                "(srun -n N bench ... --launcher slurm), or submits one with --nodes N")

        def number(name: str, value: str) -> int:
            if not value.isdigit():
                raise SlurmEnvironmentError(f"{name}={value!r} is not a number")
            return int(value)

        task = number(*need("SLURM_PROCID"))
        tasks_from, tasks_text = need("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        tasks = number(tasks_from, tasks_text)
        if not 0 <= task < tasks:
            raise SlurmEnvironmentError(f"SLURM_PROCID={task} is not a task of a step of {tasks_from}={tasks}")
        nodes_from, listed = need("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
        try:
            nodes = tuple(expand_hostlist(listed))
        except ValueError as exc:
            raise SlurmEnvironmentError(f"{nodes_from}={listed!r} is not a Slurm host list: {exc}") from None
        node_from, node_id = need("SLURM_NODEID")
        index = number(node_from, node_id)
        if index >= len(nodes):
            raise SlurmEnvironmentError(f"SLURM_NODEID={index} is not a node of {nodes_from}={listed!r} "
                                        f"({len(nodes)} nodes)")
        return cls(job_id=need("SLURM_JOB_ID", "SLURM_JOBID")[1], step_id=need("SLURM_STEP_ID", "SLURM_STEPID")[1],
                   task=task, tasks=tasks, nodes=nodes, node=nodes[index])

    @property
    def name(self) -> str:
        return f"{self.job_id}.{self.step_id}"


def in_step(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is a task of a Slurm step (started by ``srun``)."""
    return bool(env.get("SLURM_PROCID")) and bool(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"))
