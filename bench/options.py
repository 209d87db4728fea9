"""Command-line options every ``bench`` command shares, parsed and checked once.

Each parser here turns a string into a checked value or raises ``argparse.ArgumentTypeError`` with one
line naming the problem; :class:`Parser` prints that line and exits 2. Transport labels are resolved
once into a :class:`Choice` that carries what the experiment needs (the transport, its mode's options,
whether it is the ``local`` line or TensorFlow's own ``tf_grpc``), so no command parses a label again.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import transports
from bench import LOCAL, TF_GRPC
from bench.results.lines import TORCH_DDP, TORCH_RPC

EXIT_USAGE = 2
#: the distribution bench comes in (pyproject.toml's name)
PACKAGE = "tensor-transport-bench"

#: the paper's six models, then ours beyond them (embedding: a sparse gradient of dynamic shape)
MODEL_NAMES = ("alexnet", "inception_v3", "vgg16", "lstm", "gru", "fcn5", "embedding")

#: the longest --timeout (a week): longer waits overflow the clocks of threads and sockets
MAX_SECONDS = 7 * 24 * 3600.0
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(min|h|m|s|)\s*")


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line, with where to look, and exits 2.

    An argument it does not know is an error of the parser that got it: ``bench micro --bogus`` points at
    ``bench micro --help`` (argparse would hand it back to ``bench``, whose help does not list micro's options)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def version_line() -> str:
    """``bench 0.1.0 (tensor-transport-bench, commit 0123abcd4567)``: the installed package's version, and the git
    commit of its source when it runs from a checkout."""
    import importlib.metadata
    import subprocess

    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown (not installed: pip install -e .)"
    source = Path(__file__).resolve().parents[1]
    commit = None
    if (source / ".git").exists():
        try:
            done = subprocess.run(["git", "-C", str(source), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                  text=True, timeout=10, stdin=subprocess.DEVNULL)
            commit = done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None
        except (OSError, subprocess.TimeoutExpired):
            commit = None
    return f"bench {version} ({PACKAGE}{f', commit {commit}' if commit else ''})"


class VersionAction(argparse.Action):
    """``--version``: print :func:`version_line` and exit 0 (the git commit asked for only then)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version of bench (and the git commit of its source) and exit", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(version_line())
        parser.exit(0)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default said once (an option whose help already says its default, or that
    has none, gets no second "(default: ...)"), and the examples of the epilog kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or action.default is False:
            return text
        return super()._get_help_string(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        # a paragraph of indented lines (an example) stays as written; the others are filled as usual
        paragraphs = text.split("\n\n")
        return "\n\n".join(
            "\n".join(indent + line for line in paragraph.splitlines()) if paragraph.startswith(" ")
            else super(HelpFormatter, self)._fill_text(paragraph, width, indent) for paragraph in paragraphs)


def examples_epilog(examples: tuple[tuple[str, str], ...]) -> str:
    """A command's examples for its ``--help``: each command line, then what it does, indented."""
    return "examples:\n\n" + "\n\n".join(f"  {command}\n      {what}" for command, what in examples)


def fail(command: str, problem: str) -> int:
    """Print ``bench COMMAND: error: PROBLEM`` (one line; the problem names the fix) and return exit status 2."""
    print(f"bench {command}: error: {problem}", file=sys.stderr)
    return EXIT_USAGE


#: the optional parts of the install (pyproject's extras) a command may need: the modules that show each is there
EXTRAS = {"models": ("tensorflow", "keras", "sklearn"), "torch": ("torch",)}


def extras_problem(command: str, extras: tuple[str, ...]) -> str | None:
    """The one line naming an extra ``bench COMMAND`` needs and this install lacks, and how to add it; else None."""
    import importlib.util

    for extra in extras:
        missing = [module for module in EXTRAS[extra] if importlib.util.find_spec(module) is None]
        if missing:
            return (f"'bench {command}' needs the '{extra}' extra ({', '.join(missing)} not installed here): "
                    f"pip install -e '.[{extra}]' in the checkout, or pip install 'tensor-transport-bench[{extra}]'")
    return None


def error_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


# -- values ----------------------------------------------------------------------------------------------


def sizes(text: str) -> list[int]:
    """Tensor sizes: ``1KB-1GB`` (x4 steps), ``1KB-1MB:x2``, or ``1KB,64KB,1MB`` (binary units)."""
    from bench.ground.sizes import SizeError, parse_sizes

    try:
        return parse_sizes(text)
    except SizeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def memory_kinds(text: str) -> tuple[Any, Any]:
    """``--memory``: ``host``, ``cuda`` or ``cuda:N`` for both sides, or ``SENDER,RECEIVER`` (e.g. ``cuda:0,host``)."""
    from transports.memory import parse_sides

    try:
        return parse_sides(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_memory_option(parser: argparse.ArgumentParser) -> None:
    """``--memory``: where the tensors live on each side, as nixlbench's initiator and target segment types."""
    parser.add_argument("--memory", dest="memory_kinds", type=memory_kinds, default="host", metavar="KIND[,KIND]",
                        help="where the tensors live: host, cuda (device 0) or cuda:N, for both sides or as "
                        "SENDER,RECEIVER (e.g. cuda:0,host); a transport that moves host memory only stages device "
                        "memory through the host, each crossing counted (records: sender_memory, receiver_memory, "
                        "device_to_host_bytes_per_transfer, host_to_device_bytes_per_transfer). Without a GPU, cuda is "
                        "refused before any rank starts (default: host)")


def memory_kinds_problem(kinds: tuple[Any, Any]) -> str | None:
    """Why ``--memory`` cannot be used on this machine (no GPU, no device of that number, no CuPy), in one line
    naming the fix; None when it can (always for host memory)."""
    from transports.memory import cuda_problem

    for side in dict.fromkeys(kinds):
        if (problem := cuda_problem(side)) is not None:
            return f"--memory {','.join(map(str, dict.fromkeys(kinds)))}: {problem}; here use --memory host"
    return None


def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got '{text}'") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a number of at least {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _whole_number(text, 1)


def non_negative_int(text: str) -> int:
    return _whole_number(text, 0)


def int_list(text: str) -> list[int]:
    """``1,2,4``: positive whole numbers, each once, in the order given; an empty item is a mistake, not skipped."""
    parts = text.split(",")
    if not all(part.strip() for part in parts):
        raise argparse.ArgumentTypeError(f"expected a whole number or a comma list of them, e.g. 1,2,4, got '{text}'"
                                         f"{' (an empty item)' if text.strip() else ''}")
    return list(dict.fromkeys(positive_int(part) for part in parts))


def output_path(text: str) -> Path:
    """A path to write to: not empty (an empty one would be the working directory, with no name to write)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty one")
    return Path(text)


def run_dir_problem(out: Path | None) -> str | None:
    """Why ``--out DIR`` cannot become a run's results directory, as far as can be told before any work: something
    is at that name already (a run is never written over); None when nothing is, or no ``--out`` was given."""
    import os

    if out is not None and os.path.lexists(out):
        return f"{out} already exists; choose another --out"
    return None


def output_file_problem(path: Path, option: str, *, example: str, makes_dirs: bool = False) -> str | None:
    """Why the file ``path`` (given as ``option``) cannot be written, in one line naming the fix; None when, as far as
    can be told before any work, it can be: ``path`` is not a directory, and its directory is there (or, with
    ``makes_dirs``, the nearest part of it that is there), is a directory, and can be written into. ``example``: a
    file name to suggest inside ``path`` when ``path`` is a directory.

    Checked up front by the commands that write a file where ``option`` says (``analyze --json``, ``report --out``),
    so that a path that cannot take the file fails before the work, not after it."""
    import os
    import stat

    fix = f"choose another {option}"

    def status(where: Path) -> os.stat_result | None:
        try:
            return os.stat(where)
        except (FileNotFoundError, NotADirectoryError):
            return None

    try:
        if (info := status(path)) is not None and stat.S_ISDIR(info.st_mode):
            return f"{option} {path}: is a directory, not a file; give the file's path, e.g. {path / example}"
        directory = path.parent
        info = status(directory)
        while makes_dirs and info is None and directory != directory.parent:
            directory = directory.parent
            info = status(directory)
    except OSError as exc:  # a directory on the way that may not be looked into
        return f"{option} {path}: cannot look at {exc.filename or path} ({exc.strerror or exc}); {fix}"
    if info is None:
        return f"{option} {path}: the directory {directory} does not exist; create it or {fix}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{option} {path}: {directory} is not a directory; {fix}"
    if not os.access(directory, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
        why = "its file system is read-only" if read_only else "no permission to write there"
        return f"{option} {path}: cannot write into {directory} ({why}); {fix}"
    return None


def _positive_number(text: str, unit: str = "") -> float:
    """A finite number above zero; the error names the ``unit`` expected (``seconds``), if any."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {unit or 'a number'}, got '{text}'") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number{' of ' + unit if unit else ''}, got '{text}'")
    return value


def seconds(text: str) -> float:
    """A positive number of seconds, at most a week."""
    value = _positive_number(text, "seconds")
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_SECONDS:g} seconds (a week), got {value:g}")
    return value


def duration(text: str) -> float:
    """Seconds in ``600``, ``90s``, ``10m``, ``1h``, or parts of them: ``1m30s``, ``1h 30m``."""
    number = text.strip().lower()
    parts = _DURATION_PART.findall(number)
    if not parts or _DURATION_PART.sub("", number).strip():
        raise argparse.ArgumentTypeError(
            f"expected a duration such as 600, 90s, 10m, 1h or 1m30s, got '{text}'")
    total = sum(float(value) * _DURATION_UNITS[unit] for value, unit in parts)
    if len(parts) > 1 and "" in (unit for _, unit in parts):
        raise argparse.ArgumentTypeError(f"give every part of '{text}' its unit (h, m, s), e.g. 1m30s")
    if not math.isfinite(total) or total <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive duration, got '{text}'")
    if total > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected at most a week, got '{text}'")
    return total


def rate(text: str) -> float:
    """A positive finite number (a learning rate)."""
    return _positive_number(text)


def model_list(text: str) -> list[str]:
    """Model names (or ``package.module:ATTR``), comma separated."""
    chosen = [m.strip() for m in text.split(",") if m.strip()]
    if not chosen:
        raise argparse.ArgumentTypeError(f"expected a model name or a comma list of them (known: "
                                         f"{', '.join(MODEL_NAMES)}), got '{text}'")
    for name in chosen:
        if name not in MODEL_NAMES and ":" not in name:
            raise argparse.ArgumentTypeError(f"unknown model '{name}' (known: {', '.join(MODEL_NAMES)})")
    return chosen


# -- transports ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """A transport label from the command line, resolved once: ``name`` or ``name:mode``, ``local`` or ``tf_grpc``.

    ``options`` are the mode's constructor options (``grpc_rdma:direct`` -> ``{"mode": "direct"}``);
    :meth:`constructor_options` adds what the command line says about timeouts and the fabric.
    """

    label: str
    name: str
    options: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def uses_fabric(self) -> bool:
        """One of our transports, on the fabric (not ``tf_grpc``, TensorFlow's own training)."""
        return self.name in transports.REGISTRY and transports.transport_class(self.name).uses_fabric

    def constructor_options(self, args: argparse.Namespace, launcher: Any) -> dict[str, Any]:
        """The transport's constructor options: the mode's, ``timeout_s`` and, on the fabric, its backend and links."""
        options = {**self.options, "timeout_s": args.timeout}
        if self.uses_fabric:
            options["fabric"] = args.fabric
            options["fabric_transport"] = launcher.fabric_transport(args.fabric_transport)
        return options

    def __str__(self) -> str:
        return self.label


def choose(label: str, *, references: tuple[str, ...] = ()) -> Choice:
    """Resolve one label; ``references`` are the non-transport lines the command also takes (``tf_grpc``)."""
    label = label.strip()
    if label in references:
        return Choice(label, label)
    name = label.partition(":")[0]
    if name not in transports.REGISTRY:
        known = ", ".join(dict.fromkeys([*transports.names(), *references]))
        raise argparse.ArgumentTypeError(f"unknown transport '{name}' (known: {known})")
    status = transports.availability(name)
    if not status.ok:
        raise argparse.ArgumentTypeError(f"transport '{name}' is not available here: {status.reason}")
    try:
        _, options = transports.resolve(label)
    except transports.UnknownTransport as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return Choice(label, name, options)


def choices(text: str, *, references: tuple[str, ...] = ()) -> list[Choice]:
    """A comma list of labels, each resolved once (duplicates dropped)."""
    labels = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not labels:
        known = ", ".join(dict.fromkeys([*transports.names(), *references]))
        raise argparse.ArgumentTypeError(f"expected a comma list of transport names (known: {known}), got '{text}'")
    return [choose(label, references=references) for label in labels]


def transport_choices(text: str) -> list[Choice]:
    """``--transports`` of the commands that move tensors: registered transports and their modes."""
    return choices(text)


def training_lines() -> tuple[str, ...]:
    """The training lines that are not one of our transports and not ``local``: TensorFlow's and PyTorch's own
    (``bench.experiments.training.REGISTRY``)."""
    from bench.experiments.training import REGISTRY

    return tuple(name for name in REGISTRY if name != LOCAL)


def training_choices(text: str) -> list[Choice]:
    """``--transport`` of the training commands: the transports, ``local`` and the frameworks' own training lines
    (:func:`training_lines`)."""
    return choices(text, references=training_lines())


def default_choices() -> list[Choice]:
    """Every transport available here, each of its modes as a line of its own (optional modes left out)."""
    labels = []
    for name in transports.available_names():
        cls = transports.transport_class(name)
        modes = [mode for mode in cls.modes() if mode not in cls.optional_modes]
        labels += [name] if not modes else [name if i == 0 else f"{name}:{mode}" for i, mode in enumerate(modes)]
    return [choose(label) for label in labels]


def labels(chosen: list[Choice]) -> list[str]:
    return [choice.label for choice in chosen]


# -- option groups ----------------------------------------------------------------------------------------


def add_out(parser: argparse.ArgumentParser, experiment: str) -> None:
    """``--out DIR``: where the run's results go."""
    parser.add_argument("--out", type=output_path, default=None,
                        help=f"results directory (default: results/{experiment}-<time>/)")


def add_fabric_options(parser: argparse.ArgumentParser, transport_help: str) -> None:
    """``--fabric`` and ``--fabric-transport``: the RDMA device library under the fabric transports, and its links."""
    from transports import fabric

    parser.add_argument("--fabric", choices=fabric.names(), default=fabric.DEFAULT,
                        help="the RDMA device library under the fabric transports (zerocopy, rdma_cp, grpc_rdma): "
                        "ucx (UCX: shared memory here, RDMA where UCX has it; tcp on the fabric's own stream) or "
                        "verbs (pyverbs on an RDMA NIC, chosen with the RDMA_* variables); 'bench info' says which "
                        "can run here")
    offered = list(dict.fromkeys(t for name in fabric.names() for t in fabric_transports(name)))
    parser.add_argument("--fabric-transport", choices=offered, default="auto", help=transport_help)


def fabric_settings(args: argparse.Namespace, launcher: Any) -> dict[str, str]:
    """What a run's ``meta.json`` settings say of the fabric: the backend and the links it was asked for."""
    return {"fabric": args.fabric, "fabric_transport": launcher.fabric_transport(args.fabric_transport)}


def fabric_transports(name: str) -> list[str]:
    """The ``--fabric-transport`` values fabric backend ``name`` takes."""
    from transports import fabric

    try:
        return list(fabric.backend(name).fabric_transports)
    except ImportError:
        return ["auto"]


def fabric_problem(args: argparse.Namespace) -> str | None:
    """Why ``--fabric`` with ``--fabric-transport`` (and ``--launcher``) cannot run here, or None.

    Also refuses a run on the fabric that would quietly go without RDMA: ``--fabric-transport auto`` on a machine
    with an ACTIVE RDMA port that the fabric cannot reach (``bench.experiments.doctor.unreached_rdma``); runs whose
    transports use no fabric (grpc_tcp, local) are not held to it. A command that diagnoses the fabric itself (``bench
    doctor``, ``diagnoses_fabric``) is only held to the choice being offered.
    """
    from transports import fabric

    if args.fabric_transport not in fabric_transports(args.fabric):
        return (f"--fabric-transport {args.fabric_transport}: the {args.fabric} fabric takes "
                f"{', '.join(fabric_transports(args.fabric))}")
    if getattr(args, "diagnoses_fabric", False):
        return None
    netns = getattr(args, "launcher", None) == "netns"
    if args.fabric != fabric.DEFAULT and netns:
        return (f"--fabric {args.fabric} with --launcher netns: the emulated hosts' veth links carry no RDMA; "
                f"use --fabric {fabric.DEFAULT}, or another launcher")
    status = fabric.availability(args.fabric, "tcp" if netns else args.fabric_transport)
    if not status.ok:
        asked = "" if args.fabric_transport == "auto" or netns else f" --fabric-transport {args.fabric_transport}"
        return f"--fabric {args.fabric}{asked}: not available here: {status.reason}"
    if args.fabric_transport == "auto" and not netns and _uses_fabric(args):  # netns runs tcp whatever is asked
        from bench.experiments.doctor import unreached_rdma

        return unreached_rdma(args.fabric)
    return None


def _uses_fabric(args: argparse.Namespace) -> bool:
    """Whether the transports asked for (``--transports``; none given: every one available) include one on the
    fabric."""
    chosen = getattr(args, "transports", None)
    return chosen is None or any(isinstance(choice, Choice) and choice.uses_fabric for choice in chosen)


def add_launch_options(parser: argparse.ArgumentParser) -> None:
    """``--launcher``, ``--bind`` and ``--link-rate``: how and where the ranks of a run start."""
    from bench.launch import AUTO, LAUNCHERS

    parser.add_argument("--launcher", choices=[*LAUNCHERS, AUTO], default="local",
                        help="how ranks start: " + "; ".join(f"{name}: {what}" for name, what in LAUNCHERS.items())
                        + f"; {AUTO}: slurm in a task of srun, mpi under mpirun, local otherwise. Under mpi and "
                        "slurm every rank runs this same command (mpirun -np N bench ... --launcher mpi, srun -n N "
                        "bench ... --launcher slurm)")
    parser.add_argument("--bind", default=None, metavar="ADDRESS|INTERFACE",
                        help="where ranks listen (local, mpi): an address or an interface of this host. The default, "
                        "loopback, reaches ranks on this host only: when ranks run on other hosts (mpi, slurm) it "
                        "must be a non-loopback address of this host that they reach (under mpi the default is then "
                        "the address the host's name resolves to)")
    parser.add_argument("--link-rate", default=None, metavar="RATE",
                        help="netns: shape every link to RATE with tc, e.g. 10gbit, 500mbit (default: unshaped)")
    submit = parser.add_argument_group("submitting to Slurm (--launcher slurm outside a Slurm step)")
    submit.add_argument("--nodes", type=positive_int, default=None, metavar="N",
                        help="write a batch script that runs this command over N nodes (srun, --launcher slurm), "
                        "submit it with sbatch and follow the job until it ends; the results land in --out as "
                        "usual, the script and the job's output beside it. sbatch's own variables apply "
                        "(SBATCH_PARTITION, SBATCH_TIMELIMIT, SBATCH_ACCOUNT)")
    submit.add_argument("--tasks", type=positive_int, default=None, metavar="N",
                        help="with --nodes: the job's tasks, one rank each (default: the nodes, at least 2)")
    submit.add_argument("--dry-run", action="store_true",
                        help="with --nodes: print the batch script instead of submitting it")


def add_compute_option(parser: argparse.ArgumentParser, default: str) -> None:
    """``--compute real|replay|paper``: how workers spend their compute time."""
    from bench.experiments.training import COMPUTE_MODES

    parser.add_argument("--compute", choices=list(COMPUTE_MODES), default=default,
                        help="; ".join(f"{name}: {what}" for name, what in COMPUTE_MODES.items())
                        + ". Replayed records are labelled in the 'compute' column and the figures")


def add_no_plot(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-plot", action="store_true", help="do not draw the figures at the end")


def add_timeout(parser: argparse.ArgumentParser, default: float, what: str) -> None:
    parser.add_argument("--timeout", type=seconds, default=default,
                        help=f"seconds {what} may take before the run fails naming it")


def sizes_problem(chosen: list[int]) -> str | None:
    """Why a tensor of the largest size cannot be measured here (sender and receiver hold one each), or None.

    Checked against the memory available now (what others hold is not ours to take), before any rank starts."""
    from bench.ground.memory import available_memory_bytes
    from bench.ground.sizes import format_size

    memory = available_memory_bytes()
    if memory is not None and 2 * max(chosen) > memory:
        return (f"--sizes: {format_size(max(chosen))} does not fit twice (sender and receiver) in the "
                f"{memory / 2**30:.1f} GB of memory available now; choose smaller sizes or free memory")
    return None


def batch_problem(models: list[str], batch_sizes: list[int]) -> str | None:
    """Why a batch cannot be held here: one batch of a model's input alone beyond the machine's memory; else None.

    A lower bound (the activations need more): it catches a batch size that could only end in MemoryError.
    """
    from bench.experiments.models import get_model
    from bench.ground.memory import machine_memory_bytes

    memory = machine_memory_bytes()
    if memory is None:
        return None
    for name in models:
        if ":" in name:
            continue  # a model of the user's: known only once its module is imported, in the ranks
        sample = 4 * math.prod(get_model(name).input_shape)  # float32 or int32 elements
        for batch in batch_sizes:
            if batch * sample > memory:
                return (f"--batch-size {batch}: one batch of {name}'s input alone is {batch * sample / 2**30:.1f} GB, "
                        f"more than this machine's {memory / 2**30:.1f} GB of memory; choose a smaller batch size")
    return None


def add_training_options(parser: argparse.ArgumentParser, experiment: str, default_transports: str, steps: int,
                         compute: str) -> None:
    """What ``bench model`` and ``bench scale`` share: models, transports, batches, steps, compute, launch."""
    parser.add_argument("models", type=model_list, metavar="MODEL",
                        help="model name or comma list: alexnet, inception_v3, vgg16, lstm, gru, fcn5 (the paper's), "
                        "embedding (a sparse gradient whose shape changes every step)")
    parser.add_argument("--transport", "--transports", dest="transports", type=training_choices,
                        default=default_transports,
                        help=f"comma list of transports (name or name:mode), plus '{LOCAL}' (one process, no "
                        f"communication) and the frameworks' own training: '{TF_GRPC}' (TensorFlow's parameter "
                        f"server over gRPC; --framework tensorflow), '{TORCH_RPC}' (PyTorch's parameter server over "
                        f"RPC) and '{TORCH_DDP}' (PyTorch's all-reduce; both --framework torch)")
    parser.add_argument("--batch-size", dest="batch_sizes", type=int_list, default=[1],
                        help="per-worker mini-batch sizes, comma list")
    parser.add_argument("--steps", type=positive_int, default=steps, help="timed steps")
    parser.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps first")
    parser.add_argument("--learning-rate", type=rate, default=0.01, help="SGD learning rate")
    add_fabric_options(parser, "UCX transports for the fabric transports (netns: always tcp)")
    add_timeout(parser, 600.0, "one transfer, or one step of a rank,")
    add_out(parser, experiment)
    add_no_plot(parser)
    parser.add_argument("--no-analysis", action="store_true",
                        help="run zerocopy with the graph analysis off (as zerocopy:no_analysis): no tensor is "
                        "placed ahead, every one goes by dynamic allocation; list both to compare (Figure 12)")
    add_compute_option(parser, compute)
    add_launch_options(parser)
