"""Whether this machine is ready for a fabric: the checks of ``bench doctor`` and the refusal of runs that would
leave an RDMA port unused.

Each check is a pure function of values (a limit, a file's text, the devices ``rdma_devices`` read) that
returns a :class:`Check`: its state (``ok``, ``warn``, ``fail``, ``skip``), what it found and, when not ok,
the fix. A check the asked fabric needs fails; the same finding on a check it does not need is a warning,
and a check that does not apply to it is skipped, so the exit status (:func:`exit_status`) says whether
*this* fabric can run. :func:`diagnose` gathers the real values (paths in :class:`Paths`, so tests can
point it at fakes) and runs every check.

:func:`unreached_rdma` is the refusal ``bench.options.fabric_problem`` makes before any rank starts: with
``--fabric-transport auto`` on a machine with an ACTIVE RDMA port that the chosen fabric cannot reach
(``Device.rdma_reach``), a run would quietly measure shared memory or tcp instead; it names the port and
the fixes. Without ``/sys/class/infiniband`` it costs one ``stat``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import resource
import shutil
import subprocess
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from transports import fabric
from transports.fabric.base import Device, FabricError
from transports.fabric.rdma_devices import (
    Choice,
    Port,
    RdmaDevice,
    active_ports,
    gid_choice,
    missing_reason,
    read_devices,
    sysfs_root,
)
from transports.fabric.settings import RdmaSettings, SettingsError, read_settings
from transports.memory import extra_hint

if TYPE_CHECKING:
    from bench.experiments.gpus import GpuFacts

#: the capability that lifts the locked-memory limit (bit 14 of CapEff)
CAP_IPC_LOCK = 14
#: what a pool grows by (transports/fabric/pool.py's DEFAULT_SEGMENT_BYTES)
SEGMENT_BYTES = 64 << 20
#: where the ucx fabric finds a system UCX (transports/fabric/ucx: read by its build too)
UCX_HOME_VARIABLE = "TENSOR_BENCH_UCX_HOME"
UCX_VERBS_FIX = f"reinstall against a UCX with verbs ({UCX_HOME_VARIABLE}=/usr pip install -e .)"
PYVERBS_FIX = ("pip install -e '.[verbs]' (PyPI's pyverbs needs rdma-core 59 or newer), or apt install "
               "python3-pyverbs and tools/use-system-pyverbs .venv")
NO_DRIVER_FIX = ("run where the kernel has RDMA support, or try the RDMA paths on Soft-RoCE in a QEMU guest: "
                 "tools/softroce .venv/bin/bench doctor --fabric verbs")
NO_DEVICE_FIX = ("load the NIC's driver (e.g. modprobe mlx5_ib), or add Soft-RoCE to try the RDMA paths: "
                 "modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0")
#: fabric transports that ask for RDMA only (the ucx fabric's ``rdma``, where it has one)
RDMA_ONLY = ("rdma",)


@dataclass(frozen=True)
class Check:
    """One line of ``bench doctor``: the check's name, its state, what it found and, when not ok, the fix."""

    name: str
    state: str
    finding: str
    fix: str = ""


@dataclass(frozen=True)
class Needs:
    """What ``--fabric`` with ``--fabric-transport`` needs of this machine.

    ``rdma``: an RDMA port it reaches (verbs always; ucx when asked for RDMA only); ``rdma_wanted``: it would use
    one if it can (also ucx on auto); ``shm``: /dev/shm and cma (ucx on auto or shm).
    """

    fabric: str
    fabric_transport: str
    rdma: bool
    rdma_wanted: bool
    shm: bool

    @classmethod
    def of(cls, name: str, fabric_transport: str) -> Needs:
        verbs = name == "verbs"
        rdma = verbs or fabric_transport in RDMA_ONLY
        return cls(name, fabric_transport, rdma=rdma, rdma_wanted=rdma or fabric_transport == "auto",
                   shm=not verbs and fabric_transport in ("auto", "shm"))


def _state(bad: bool, needed: bool, applies: bool = True) -> str:
    """``ok`` unless ``bad``; a bad finding fails a check the fabric needs and warns on one it does not; ``skip``
    for a check that does not apply to the fabric asked."""
    if not applies:
        return "skip"
    return "ok" if not bad else "fail" if needed else "warn"


def size_text(nbytes: int) -> str:
    """Bytes in binary units, briefly: ``2.6 GB``, ``64 MB``, ``8 KB``."""
    for unit, scale in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value >= 10 or value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def run_memory(sizes: list[int]) -> int:
    """What one rank of a ``bench micro`` sweep over ``sizes`` may register, in whole MB: every size twice (pool
    segments are kept across sizes; rdma_cp stages and grpc_rdma buffers a copy of each) and a pool segment."""
    return -(-(2 * sum(sizes) + SEGMENT_BYTES) // (1 << 20)) << 20


# -- checks: pure functions of values ---------------------------------------------------------------------


def rdma_checks(devices: list[RdmaDevice], missing: str | None, settings: RdmaSettings | str, needs: Needs,
                root: str = "/sys/class/infiniband") -> list[Check]:
    """A line per RDMA port (state, link layer, active MTU, the GID index a verbs run would use), or one saying
    why there is none. ``settings``: the RDMA_* variables, or the error reading them."""
    bad = _state(True, needs.rdma, needs.rdma_wanted)
    if missing is not None or not any(device.ports for device in devices):
        fix = NO_DRIVER_FIX if missing and "cannot load a driver" in missing else NO_DEVICE_FIX
        return [Check("rdma", bad, f"none: {missing or f'no device under {root} has a port'}", fix)]
    checks = []
    if isinstance(settings, str):
        checks.append(Check("rdma settings", bad, settings, "correct or unset that variable"))
        settings = RdmaSettings()
    any_active = bool(active_ports(devices))
    chosen = gid_choice(devices, settings)
    for device in devices:
        for port in device.ports:
            # a port down fails the check only when no other port is up to carry the run
            down = _state(True, needs.rdma and not any_active, needs.rdma_wanted)
            checks.append(_port_check(device, port, devices, settings, chosen, down, bad))
    if isinstance(chosen, str) and chosen.startswith("RDMA_"):  # other reasons are on the port lines already
        checks.append(Check("rdma choice", bad, chosen, "correct or unset that variable"))
    return checks


def _port_check(device: RdmaDevice, port: Port, devices: list[RdmaDevice], settings: RdmaSettings,
                chosen: Choice | str, down: str, bad: str) -> Check:
    where = [device.kind] if device.software else []
    if port.netdev:
        where.append(f"on {port.netdev}")
    place = f" ({', '.join(where)})" if where else ""
    described = f"{port.name}{place}: {port.state_name}, {port.phys_state}, {port.kind}"
    if not port.active:
        return Check("rdma port", down, described, _inactive_fix(port))
    details = [port.mtu_text, *([port.rate] if port.rate else []), *([] if port.ethernet else [f"LID {port.lid:#x}"])]
    choice = gid_choice(devices, settings, port)
    if isinstance(choice, str):
        reason = choice.removeprefix("verbs: ")
        iface = port.netdev or "IFACE"
        fix = (f"give {iface} an IP address (ip addr add ADDRESS/PREFIX dev {iface}), or set RDMA_GID_INDEX"
               if "has no GID" in reason else "correct or unset that variable")
        return Check("rdma port", bad, f"{described}, {', '.join(details)}; {reason}", fix)
    if choice.gid_index is None:
        details.append("LID routing (no GID index unless RDMA_GID_INDEX)")
    else:
        gid = next((g for g in port.gids if g.index == choice.gid_index), None)
        kind = f"{gid.type} " if gid and gid.type else ""
        details.append(f"GID index {choice.gid_index} ({kind}{gid.text if gid else '?'})")
    used = not isinstance(chosen, str) and (chosen.device, chosen.port) == (port.device, port.number)
    return Check("rdma port", "ok", f"{described}, {', '.join(details)}{'; --fabric verbs uses it' if used else ''}")


def _inactive_fix(port: Port) -> str:
    if port.ethernet:
        iface = port.netdev or "its interface"
        return f"bring {iface} up (ip link set {iface} up) and check its link (cable, switch port)"
    if port.phys_state == "LinkUp":
        return "the link is up but no subnet manager has configured the port: run opensm on the fabric"
    return "no link: check the cable and the switch port (ibstat shows the physical state)"


def memlock_check(soft: int, hard: int, cap_eff: int, memory: int, needed: bool) -> Check:
    """The locked-memory limit (``RLIMIT_MEMLOCK``, bytes; ``resource.RLIM_INFINITY`` for none) against the
    ``memory`` a run registers; CAP_IPC_LOCK in ``cap_eff`` (the effective capability set) lifts it."""
    unlimited = resource.RLIM_INFINITY
    if soft == unlimited:
        return Check("locked memory", "ok", f"unlimited; a run registers up to {size_text(memory)}")
    if cap_eff >> CAP_IPC_LOCK & 1:
        return Check("locked memory", "ok", f"limit {size_text(soft)}, lifted by CAP_IPC_LOCK (root); a run "
                     f"registers up to {size_text(memory)}")
    if soft >= memory:
        return Check("locked memory", "ok", f"limit {size_text(soft)}; a run registers up to {size_text(memory)}")
    hard_text = "unlimited" if hard == unlimited else size_text(hard)
    if hard == unlimited or hard >= memory:
        fix = (f"raise it before the run: ulimit -l {hard_text if hard == unlimited else -(-memory // 1024)} "
               "(the hard limit allows it)")
    else:
        fix = ("raise it as root: ulimit -l unlimited, or memlock in /etc/security/limits.conf (systemd: "
               "LimitMEMLOCK=infinity, docker: --ulimit memlock=-1)")
    return Check("locked memory", _state(True, needed),
                 f"limit {size_text(soft)} (hard {hard_text}): a run registers up to {size_text(memory)}, and "
                 f"registrations beyond the limit fail", fix)


def capabilities(status_text: str) -> int:
    """The effective capability set (``CapEff``) of a ``/proc/<pid>/status`` text; 0 if it is not there."""
    match = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", status_text, re.MULTILINE)
    return int(match.group(1), 16) if match else 0


def hugepage_check(thp_text: str | None, meminfo_text: str | None) -> Check:
    """Transparent huge pages (``.../transparent_hugepage/enabled``: ``always [madvise] never``) and the reserved
    huge pages of ``/proc/meminfo``: large registered regions on huge pages need fewer translation entries."""
    selected = re.search(r"\[(\w+)\]", thp_text or "")
    mode = selected.group(1) if selected else None
    fields = dict(re.findall(r"^(HugePages_Total|Hugepagesize):\s*(\d+)", meminfo_text or "", re.MULTILINE))
    reserved = (f"; reserved huge pages: {fields['HugePages_Total']} x {size_text(int(fields['Hugepagesize']) << 10)}"
                if {"HugePages_Total", "Hugepagesize"} <= fields.keys() else "")
    if mode is None:
        return Check("huge pages", "warn", f"transparent huge pages: not available{reserved}",
                     "a kernel with CONFIG_TRANSPARENT_HUGEPAGE lets large regions use 2 MB pages")
    if mode == "never":
        return Check("huge pages", "warn", f"transparent huge pages: never{reserved}",
                     "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled (as root)")
    return Check("huge pages", "ok", f"transparent huge pages: {mode}{reserved}")


def ptrace_check(scope_text: str | None, applies: bool) -> Check:
    """Yama's ``ptrace_scope``: UCX's cma (single-copy shared memory) needs 0 to copy into a sibling process."""
    if scope_text is None:
        return Check("ptrace scope", _state(False, False, applies), "no Yama: cma may copy between processes")
    scope = scope_text.strip()
    if scope == "0":
        return Check("ptrace scope", _state(False, False, applies), "0: cma may copy between processes")
    fix = ("3 holds until reboot: boot with kernel.yama.ptrace_scope=0" if scope == "3"
           else "sysctl -w kernel.yama.ptrace_scope=0 (as root)")
    return Check("ptrace scope", _state(True, False, applies), f"{scope}: cma cannot reach a sibling rank; "
                 "ucx's shared memory falls back to copies through a segment", fix)


def shm_check(free: int | None, total: int | None, memory: int, needs: Needs) -> Check:
    """``/dev/shm`` (``free``/``total`` bytes, None when missing), where UCX's shared-memory segments live."""
    if free is None or total is None:
        return Check("/dev/shm", _state(True, True, needs.shm), "missing: UCX's shared memory transports cannot run",
                     "mount -t tmpfs -o size=4G tmpfs /dev/shm (as root)")
    found = f"{size_text(free)} free of {size_text(total)}; a run asks for {size_text(memory)}"
    if free >= memory:
        return Check("/dev/shm", _state(False, False, needs.shm), found)
    gigabytes = -(-memory // (1 << 30))
    return Check("/dev/shm", _state(True, False, needs.shm), found,
                 f"mount -o remount,size={gigabytes}G /dev/shm (as root; docker: --shm-size={gigabytes}g)")


@dataclass(frozen=True)
class Library:
    """A fabric library as its own tool reports it: version, where it comes from, the transports it offers
    (transport -> devices), ``--without-...`` words of how it was configured, or why the tool could not run."""

    version: str | None = None
    origin: str = ""
    transports: dict[str, list[str]] = field(default_factory=dict)
    without: tuple[str, ...] = ()
    error: str | None = None

    def describe(self) -> str:
        """``UCX 1.22.0 (libucx-cu12 wheel, --without-verbs: self, tcp, sysv, posix, cma)``."""
        built = ", ".join([self.origin, *self.without])
        offered = f": {', '.join(self.transports)}" if self.transports else ""
        return f"UCX {self.version or '(version unknown)'} ({built}{offered})"


def ucx_check(available: str | None, library: Library, ports: list[Port], reach: list[str], needs: Needs) -> Check:
    """The UCX in use: ``available`` is why the ucx fabric cannot run (None when it can), ``library`` what its
    ucx_info says, ``reach`` its transports on the active RDMA ``ports``."""
    needed = needs.fabric == "ucx"
    if available is not None:
        return Check("ucx", _state(True, needed, needed), f"not available: {available}",
                     f"rebuild the binding: pip install -e . (with {UCX_HOME_VARIABLE} as the runs will have it)")
    found = library.describe()
    if library.error is not None:
        return Check("ucx", _state(bool(ports) and needs.rdma_wanted, needed, needed),
                     f"{found}; ucx_info could not run: {library.error}",
                     "install ucx_info beside the UCX in use (the wheel ships it; Debian: apt install ucx-utils)")
    if not ports:
        return Check("ucx", _state(needs.rdma, needed, needed), f"{found}; no active RDMA port here",
                     "see the rdma line")
    names = ", ".join(port.name for port in ports)
    if reach:
        return Check("ucx", _state(False, needed, needed), f"{found}; reaches {', '.join(reach)}")
    if not needs.rdma_wanted:
        return Check("ucx", _state(False, needed, needed), f"{found}; reaches none of {names} (--fabric-transport "
                     f"{needs.fabric_transport} asks for no RDMA)")
    return Check("ucx", _state(True, needed, needed), f"{found}; reaches none of {names}",
                 f"use --fabric verbs, or {UCX_VERBS_FIX}, or ask for --fabric-transport shm or tcp")


def pyverbs_check(error: str | None, version: str | None, origin: str, rdma_core: str | None, reach: list[str],
                  unavailable: str | None, sysfs_ports: list[Port], needs: Needs) -> Check:
    """pyverbs: whether it imports (``error`` otherwise), its ``version`` and ``origin``, the system's rdma-core
    (from libibverbs' file name), and the active ports it lists (``reach``; ``unavailable``: the verbs fabric's
    reason when it lists none)."""
    needed = needs.fabric == "verbs"
    library = f"libibverbs of rdma-core {rdma_core}" if rdma_core else "no libibverbs.so.1"
    if error is not None:
        return Check("pyverbs", _state(True, needed, needed), f"cannot import pyverbs ({error}); {library}",
                     PYVERBS_FIX)
    found = f"pyverbs {version or '(version unknown)'} ({origin}); {library}"
    if reach:
        return Check("pyverbs", _state(False, needed, needed), f"{found}; lists {', '.join(reach)} active")
    if sysfs_ports:
        fix = (f"sysfs shows {', '.join(p.name for p in sysfs_ports)} active but pyverbs lists none: install the "
               "device's provider (ibverbs-providers) and check that /dev/infiniband/uverbs* is readable")
    else:
        fix = "see the rdma line"
    return Check("pyverbs", _state(True, needed, needed), f"{found}; {unavailable or 'lists no active port'}", fix)


def perftest_check(found: Mapping[str, str | None], needs: Needs) -> Check:
    """perftest's ``ib_write_bw`` and ``ib_write_lat`` (path or None): the verbs fabric's reference lines."""
    applies = needs.fabric == "verbs"
    missing = [name for name, path in found.items() if path is None]
    if not missing:
        where = sorted({str(Path(path).parent) for path in found.values() if path})
        return Check("perftest", _state(False, False, applies), f"{', '.join(found)} in {', '.join(where)}")
    return Check("perftest", _state(True, False, applies),
                 f"{', '.join(missing)} not on PATH: bench micro draws no ib_write reference line",
                 "apt install perftest")


def exit_status(checks: list[Check]) -> int:
    """0 when no check failed (the machine is ready for the fabric asked), else 1."""
    return 1 if any(check.state == "fail" for check in checks) else 0


def format_checks(checks: list[Check]) -> list[str]:
    """The table: state, check, finding, and for a check not ok, the fix on the same line."""
    width = max((len(check.name) for check in checks), default=0)
    lines = []
    for check in checks:
        fix = f"  -> fix: {check.fix}" if check.fix and check.state in ("warn", "fail") else ""
        lines.append(f"{check.state:4}  {check.name:{width}}  {check.finding}{fix}")
    return lines


# -- what the system says ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Paths:
    """Where the checks read the system (tests point them at fakes)."""

    rdma: Path = field(default_factory=sysfs_root)
    thp: Path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    meminfo: Path = Path("/proc/meminfo")
    ptrace: Path = Path("/proc/sys/kernel/yama/ptrace_scope")
    status: Path = Path("/proc/self/status")
    shm: Path = Path("/dev/shm")


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def ucx_library(cls: type[Device], environ: Mapping[str, str] = os.environ) -> Library:
    """The UCX of the ucx fabric, from its ``ucx_info`` (``-v``: version and configuration, ``-d``: transports)."""
    home = environ.get(UCX_HOME_VARIABLE)
    origin = f"{UCX_HOME_VARIABLE}={home}" if home else "libucx-cu12 wheel"
    try:
        tool = cls.tool("ucx_info")
        version = subprocess.run([str(tool.path), "-v"], capture_output=True, text=True, timeout=60,
                                 env=tool.environment)
    except (OSError, subprocess.SubprocessError, FabricError) as exc:
        return Library(origin=origin, error=str(exc))
    number = re.search(r"version:?\s*([\d.]+)", version.stdout, re.IGNORECASE)
    without = tuple(dict.fromkeys(re.findall(r"--without-verbs", version.stdout)))
    return Library(number.group(1) if number else None, origin, cls.links(), without)


def _availability(name: str, fabric_transport: str = "auto") -> str | None:
    try:
        status = fabric.availability(name, fabric_transport)
    except Exception as exc:  # a doctor reports what breaks, it does not break on it
        return f"{type(exc).__name__}: {exc}"
    return None if status.ok else status.reason


def _reach(name: str, ports: list[Port]) -> list[str]:
    if not ports:
        return []
    try:
        return fabric.backend(name).rdma_reach([port.name for port in ports])
    except Exception:  # as above
        return []


def _pyverbs() -> tuple[str | None, str | None, str]:
    """(import error, version, origin) of pyverbs."""
    try:
        module = importlib.import_module("pyverbs.device")
    except Exception as exc:  # PyPI's pyverbs fails to load on an older rdma-core in many ways
        return f"{type(exc).__name__}: {exc}", None, ""
    where = os.path.realpath(module.__file__ or "")
    if where.startswith("/usr/lib/python3/dist-packages/"):
        try:
            version = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "python3-pyverbs"],
                                     capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            version = None
        return None, version, "Debian python3-pyverbs"
    try:
        return None, importlib.metadata.version("pyverbs"), "PyPI"
    except importlib.metadata.PackageNotFoundError:
        return None, None, str(Path(where).parent)


def rdma_core_version() -> str | None:
    """The rdma-core release of the system's ``libibverbs.so.1`` (``1.14.44.0`` -> ``44.0``), None if absent."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    for directory in (f"/usr/lib/{multiarch}", "/usr/lib64", "/usr/lib"):
        library = Path(directory) / "libibverbs.so.1"
        if library.exists():
            match = re.search(r"libibverbs\.so\.1\.\d+\.(\d+(?:\.\d+)*)$", os.path.realpath(library))
            return match.group(1) if match else "(unknown release)"
    return None


def diagnose(name: str, fabric_transport: str, memory: int, paths: Paths | None = None) -> list[Check]:
    """Every check for ``--fabric name --fabric-transport fabric_transport`` with ``memory`` bytes registered."""
    paths = paths or Paths()
    needs = Needs.of(name, fabric_transport)
    try:
        settings: RdmaSettings | str = read_settings()
    except SettingsError as exc:
        settings = str(exc)
    gid_index = settings.gid_index if isinstance(settings, RdmaSettings) else None
    devices = read_devices(paths.rdma, gid_index=gid_index)
    ports = active_ports(devices)
    checks = rdma_checks(devices, missing_reason(paths.rdma), settings, needs, str(paths.rdma))
    reach = {backend: _reach(backend, ports) for backend in fabric.names()}
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    uses_rdma = needs.rdma or (needs.rdma_wanted and bool(reach.get(name)))
    checks.append(memlock_check(soft, hard, capabilities(_text(paths.status) or ""), memory, uses_rdma))
    checks.append(hugepage_check(_text(paths.thp), _text(paths.meminfo)))
    checks.append(ptrace_check(_text(paths.ptrace), needs.shm))
    try:
        stat = os.statvfs(paths.shm)
        free, total = stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize
    except OSError:
        free = total = None
    checks.append(shm_check(free, total, memory, needs))
    unavailable = unavailable_ucx = _availability("ucx")  # whether the binding loads; what it reaches: its finding
    library = Library() if unavailable else ucx_library(fabric.backend("ucx"))
    checks.append(ucx_check(unavailable, library, ports, reach["ucx"], needs))
    error, version, origin = _pyverbs()
    unavailable = None if error or reach["verbs"] else _availability("verbs")
    checks.append(pyverbs_check(error, version, origin, rdma_core_version(), reach["verbs"], unavailable, ports,
                                needs))
    # perftest's programs: the verbs fabric's reference tools, each named as the reference line it draws
    perftest = fabric.backend("verbs").reference_tools
    checks.append(perftest_check({tool: shutil.which(tool) for tool in perftest}, needs))
    from bench.experiments.gpus import gpu_facts

    has_verbs = not unavailable_ucx and library.error is None and "--without-verbs" not in library.without
    checks += gpu_checks(gpu_facts([port.name for port in ports], library.transports, has_verbs))
    return checks


def gpu_checks(facts: GpuFacts) -> list[Check]:
    """The GPU lines: the devices and CuPy, cuda_ipc between two processes, GPUDirect RDMA's prerequisites. Only
    ``--memory cuda`` runs need them: without a GPU they are skipped, and none fails the fabric's readiness."""
    found = facts.driver
    if found.problem is not None:
        return [Check("gpu", "skip", f"{found.problem}: --memory cuda is refused, host memory runs")]
    devices = ", ".join(f"cuda:{gpu.index} {gpu.name}" for gpu in found.gpus)
    if (note := found.capped_note()) is not None:
        devices = f"{devices} ({note})"
    cuda = f"CUDA {found.cuda_version[0]}.{found.cuda_version[1]}" if found.cuda_version else "CUDA ?"
    if facts.cupy_problem is not None:
        checks = [Check("gpu", "warn", f"{devices} ({cuda}); {facts.cupy_problem}", extra_hint(found))]
    else:
        checks = [Check("gpu", "ok", f"{devices} ({cuda}); CuPy {facts.cupy}, runtime {facts.runtime}")]
    if facts.cuda_ipc == "works":
        checks.append(Check("cuda_ipc", "ok", "a device buffer exported here is read by a second process"))
    elif facts.cuda_ipc.startswith("not tried"):
        checks.append(Check("cuda_ipc", "skip", facts.cuda_ipc))
    else:
        checks.append(Check("cuda_ipc", "warn", facts.cuda_ipc,
                            "both processes must see the same GPU (CUDA_VISIBLE_DEVICES), and in a container share "
                            "its IPC namespace (--ipc=host); without cuda_ipc UCX stages through cuda_copy"))
    missing = [p for p in facts.gpudirect if not p.met]
    if not missing:
        checks.append(Check("gpudirect", "ok", "; ".join(p.finding for p in facts.gpudirect)))
    else:
        checks.append(Check("gpudirect", "warn", "would not work: " + "; ".join(p.finding for p in missing),
                            "; ".join(p.fix for p in missing) + " (without it, device memory is staged through the "
                            "host across hosts)"))
    return checks


# -- the refusal before a run ---------------------------------------------------------------------------------


def refusal(name: str, ports: list[Port], library: str, others: list[str], without_rdma: list[str]) -> str:
    """The line refusing ``--fabric name`` on a machine whose active RDMA ``ports`` it cannot reach: the ports and
    the fixes (``others``: the other fabrics; ``without_rdma``: the fabric transports that ask for no RDMA)."""
    plural = "s" if len(ports) > 1 else ""
    named = "; ".join(f"{port.name}, {port.kind}" for port in ports)
    fixes = [f"use --fabric {other}" for other in others]
    if name == fabric.DEFAULT:
        fixes.append(UCX_VERBS_FIX)
    if without_rdma:
        fixes.append(f"ask for --fabric-transport {' or '.join(without_rdma)} to run without RDMA")
    return (f"--fabric {name}: this machine has {'active RDMA ports' if plural else 'an active RDMA port'} ({named}) "
            f"that the {name} fabric{library} cannot reach; {', or '.join(fixes)}")


def unreached_rdma(name: str, root: Path | None = None) -> str | None:
    """Why ``--fabric name`` with ``--fabric-transport auto`` must not run here (an ACTIVE RDMA port it cannot
    reach: the run would quietly go over shared memory or tcp), or None. One ``stat`` when there is no RDMA."""
    root = sysfs_root() if root is None else root
    if not root.is_dir():
        return None
    ports = active_ports(read_devices(root))
    if not ports:
        return None
    cls = fabric.backend(name)
    if cls.rdma_reach([port.name for port in ports]):
        return None
    library = ""
    if "ucx_info" in cls.reference_tools:
        found = ucx_library(cls)
        library = f"'s {found.describe()}" if found.error is None else ""
    others = [other for other in fabric.names() if other != name]
    without_rdma = [t for t in cls.fabric_transports if t != "auto" and t not in RDMA_ONLY]
    return refusal(name, ports, library, others, without_rdma)


def describe_devices(devices: list[RdmaDevice]) -> list[str]:
    """``bench info``'s lines for the RDMA devices: each device, its ports' states and GIDs."""
    lines = []
    for device in devices:
        kind = f"{device.kind}, software" if device.software and device.kind != "software" else device.kind
        lines.append(f"{device.name:8} {kind}{f' ({device.node_desc})' if device.node_desc else ''}")
        for port in device.ports:
            on = f" on {port.netdev}" if port.netdev else ""
            lid = "" if port.ethernet else f", LID {port.lid:#x}"
            lines.append(f"{'':8}   port {port.number}: {port.state_name} ({port.phys_state}), {port.kind}{on}, "
                         f"{port.mtu_text}{lid}{f', {port.rate}' if port.rate else ''}")
            if port.gids:
                gids = "; ".join(f"{gid.index} {gid.text}{f' {gid.type}' if gid.type else ''}" for gid in port.gids)
                lines.append(f"{'':8}   GIDs: {gids}")
    return lines
