"""The page's overview: the runs of the report, and the paper's cluster against the one the runs ran on."""

from __future__ import annotations

from bench.ground import paper
from bench.readers.report.notes import describe_fabric
from bench.readers.report.page import Report, Table
from bench.readers.report.text import line_kinds, listing, unique
from bench.results import lines as catalogue
from bench.results.records import FRAMEWORK_TITLES, OLD_FRAMEWORK, framework_title


def frameworks_text(report: Report) -> str:
    """The frameworks of the report's runs with their versions: those their records trained (the version the records
    name, else meta.json's), or for runs that trained none (micro) those installed where they ran; TensorFlow's
    version alone (``?`` when unknown) when neither says more."""
    used = list(dict.fromkeys(name for _, run in report.runs for name in run.frameworks))
    parts = []
    for name in used or FRAMEWORK_TITLES:
        versions: list[str] = []
        for _, run in report.runs:
            installed = str((run.meta.get("packages") or {}).get(name, "?"))
            if used and name in run.frameworks:
                records = run.records[run.records["framework"] == name]
                versions += [str(v) for v in unique(records, "framework_version")] or [installed]
            elif not used and installed not in ("?", "not installed"):
                versions.append(installed)
        if versions:
            parts.append(f"{framework_title(name)} {listing(dict.fromkeys(versions))}")
    return "; ".join(parts) or f"{framework_title(OLD_FRAMEWORK)} ?"


def overview_tables(report: Report) -> list[Table]:
    """The runs (directory, experiment, status, where) and the paper's setup against this machine's."""
    runs = Table("runs", "The runs of this report", ["run", "experiment", "status", "started", "host", "cores",
                                                     "CPU", "schema", "commit"],
                 [[label, run.experiment, str(run.meta.get("status", "?")), str(run.meta.get("start_time", "?")),
                   str(run.meta.get("host", "?")), str(run.meta.get("cpu_count", "?")), str(run.meta.get("cpu", "?")),
                   str(run.schema_version), str(run.meta.get("git_commit", "?"))[:12]]
                  for label, run in report.runs])
    metas = [run.meta for _, run in report.runs]
    names: list[str] = []
    emulated = False
    for meta in metas:
        names.append(str(meta.get("host", "?")))
        launcher = (meta.get("settings") or {}).get("launcher")
        if isinstance(launcher, dict) and "world_size" in launcher:  # a job's (mpi, slurm): its ranks' real hosts
            names += [str(h) for h in launcher.get("hosts") or []]
        emulated = emulated or (isinstance(launcher, dict) and launcher.get("launcher") == "netns")
    distinct = list(dict.fromkeys(names))
    hosts = f"{len(distinct)} host(s): {listing(distinct)}" + (
        "; netns runs emulate hosts as network namespaces of one" if emulated else "")
    cpus = listing(dict.fromkeys(f"{m.get('cpu_count', '?')} cores of {m.get('cpu', '?')}" for m in metas))
    fabrics = []
    for _, run in report.runs:
        records = run.records
        if "transport" in records:  # the fabrics of this suite's lines, not of the references' and peers'
            kinds = line_kinds(records)
            records = records[[kinds[str(name)] not in catalogue.OTHERS_KINDS for name in records["transport"]]]
        fabrics += [f for f in unique(records, "fabric") if f != "none"]
    python = listing(dict.fromkeys(str((m.get("packages") or {}).get("python", "?")) for m in metas))
    setup = Table("setup", f"The paper's cluster ({paper.SETUP_SECTION}) and this one", ["", "paper", "here"], [
        ["servers", str(paper.SETUP["servers"]), hosts],
        ["CPU", paper.SETUP["cpu"], cpus],
        ["GPU", paper.SETUP["gpu"], "none: models compute on the CPU (or replay compute times)"],
        ["network", paper.SETUP["network"],
         listing(describe_fabric(f) for f in dict.fromkeys(fabrics)) or "no fabric line in these runs"],
        ["software", paper.SETUP["software"], f"{frameworks_text(report)}, Python {python}"],
    ])
    return [runs, setup]
