"""Emulated hosts on one machine: network namespaces on a bridge, every link shaped by ``tc``.

For ``EmulatedHosts(n, rate)`` with the prefix ``tbench-<pid>-<nonce>`` (the creating process and a
random nonce, so parallel runs never collide and :func:`sweep_stale` can tell whether the owner lives):

- ``<prefix>-sw`` is the switch: a bridge ``br0`` with one port ``p<i>`` per host;
- ``<prefix>-h<i>`` is host *i*: ``lo`` and ``tb0`` (198.18.0.<i+1>/24, RFC 2544's benchmarking range),
  the other end of ``p<i>``. There is no route off the bridge, so no traffic leaves the run.

The veth pairs are created directly inside their namespaces, so nothing is ever named in the root
namespace. With a link rate, ``tbf`` shapes both directions of every link: egress of ``tb0`` in the
host (host to switch) and egress of ``p<i>`` in the switch (switch to host).

Cleanup after a crash: :meth:`EmulatedHosts.create` first starts a :class:`Reaper` (this file run as
``python -I hosts.py reap [--dir PATH]... NAMES...``, in a session of its own so that a signal to the
creator's process group spares it) whose stdin is the read end of a pipe only the creator holds. A clean
:meth:`EmulatedHosts.close` tears down, writes ``closed`` and closes the pipe; the reaper exits. When
the creator dies instead (even by SIGKILL) the reaper reads EOF without ``closed``, kills what runs
in the namespaces, deletes them and the directories it was given, and exits, so no reaper outlives its
hosts. The local launcher's hub directory (its socket, the ranks' logs) has a reaper too. Programs that
listen on every interface (TensorFlow's servers, perftest's tools) run on a private emulated host of their
own (:func:`bench.launch.private.private_hosts`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time

NETNS_DIR = "/var/run/netns"  # where `ip netns` keeps the names (bind mounts of the namespaces)
NAME_PREFIX = "tbench"
SUBNET = "198.18.0"  # the first /24 of 198.18.0.0/15 (RFC 2544)
BRIDGE = "br0"
MAX_HOSTS = 254  # 198.18.0.1 .. 198.18.0.254

_NAME = re.compile(rf"^{NAME_PREFIX}-(\d+)-([0-9a-f]+)-(sw|h\d+|lo)$")
_CLOSED = b"closed"
_KILL_WAIT_S = 20.0
_REAPER_EXIT_WAIT_S = 30.0
_ETH_FRAME = 1514  # largest frame at the default MTU, what tbf must pass in one piece


class NetnsUnavailable(RuntimeError):
    """Emulated hosts cannot run here; the message names what is missing and the fix."""


class CommandError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message names the command and its stderr."""

    def __init__(self, argv: list[str], detail: str) -> None:
        super().__init__(f"`{shlex.join(argv)}` failed: {detail}")
        self.argv = argv
        self.detail = detail


def _run(argv: list[str], timeout_s: float = 60.0) -> str:
    """Run a command and return its stdout; raise :class:`CommandError` naming it and its stderr."""
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CommandError(argv, str(exc)) from exc
    if done.returncode != 0:
        raise CommandError(argv, done.stderr.strip() or f"exit status {done.returncode}")
    return done.stdout


def tbf_parameters(rate_bps: int) -> tuple[int, int]:
    """The ``tbf`` (burst, limit) in bytes used for a link of ``rate_bps``; see the comment for why."""
    rate = rate_bps / 8  # bytes per second
    # burst, the largest of:
    # - 2 ms at the rate. tbf sends only when its watchdog timer fires and drops tokens beyond the
    #   burst, so a burst shorter than the timer's lateness on a busy machine caps high rates
    #   (10gbit) below the setting;
    # - 128 KiB, two 64 KiB GSO packets: veth carries TCP super-packets unsplit and tbf splits every
    #   packet longer than the burst into frames in software, per-packet CPU work best kept off
    #   fast links. This floor applies only while it is at most 50 ms of traffic (from about
    #   20mbit), so slow links keep a short burst and tbf splits their super-packets, cheap there;
    # - two full frames (a burst below one frame passes nothing).
    # The error is bounded by the burst: in any window W a link moves at most rate*W + burst, e.g.
    # 100mbit with 128 KiB is within 1% over a second.
    burst = max(rate * 0.002, min(128 * 1024, rate * 0.050), 2 * _ETH_FRAME)
    # queue: 10 ms at the rate beyond the burst, a switch-like buffer that absorbs incast (several
    # senders to one port) without turning every transfer's latency into queueing delay.
    limit = burst + max(rate * 0.010, 2 * _ETH_FRAME)
    return int(burst), int(limit)


def check_support() -> None:
    """Raise :class:`NetnsUnavailable` unless namespaces, veth, a bridge and tbf can be built here (probed)."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("emulated hosts need root (network namespaces, veth, tc): run as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"`{tool}` not found on PATH: install iproute2 (e.g. apt-get install iproute2)")
    probe = EmulatedHosts(1, link_rate_bps=10**9)
    try:
        probe.create()
    except CommandError as exc:
        raise NetnsUnavailable(
            f"the kernel refused a namespace, veth, bridge or tbf qdisc ({exc}); run on a kernel with "
            "CONFIG_NET_NS, CONFIG_VETH, CONFIG_BRIDGE and CONFIG_NET_SCH_TBF, outside a restricted container"
        ) from exc
    finally:
        probe.close()


def _identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _kill_if_inside(pid: int, namespace: tuple[int, int]) -> None:
    """SIGKILL ``pid`` if it is (still) a process in the namespace, never a process that reused its pid."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        # The pidfd pins the process: if /proc/<pid> is in the namespace now, the signal reaches that
        # process, or nobody if it has died since.
        if _identity(f"/proc/{pid}/ns/net") == namespace:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
        pass
    finally:
        os.close(pidfd)


def _kill_inside(name: str) -> list[int]:
    """SIGKILL every process in namespace ``name`` until none is left (bounded); return any survivors."""
    path = os.path.join(NETNS_DIR, name)
    deadline = time.monotonic() + _KILL_WAIT_S
    while True:
        try:
            namespace = _identity(path)
            pids = [int(pid) for pid in _run(["ip", "netns", "pids", name]).split()]
        except (FileNotFoundError, CommandError):
            if os.path.exists(path):
                raise
            return []  # already gone
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            _kill_if_inside(pid, namespace)
        time.sleep(0.05)


def _teardown(names: list[str]) -> None:
    """Kill the processes in the namespaces, then delete them; what is already gone is no error."""
    problems = []
    for name in names:
        try:
            survivors = _kill_inside(name)
        except (OSError, CommandError) as exc:
            problems.append(str(exc))
            continue
        if survivors:
            problems.append(f"processes {survivors} in namespace {name} survived SIGKILL for {_KILL_WAIT_S:.0f} s")
    for name in names:
        try:
            _run(["ip", "netns", "delete", name])
        except CommandError as exc:
            if os.path.exists(os.path.join(NETNS_DIR, name)):
                problems.append(str(exc))
    if problems:
        raise RuntimeError("tearing down emulated hosts: " + "; ".join(problems))


# Write ends of the reapers' pipes (these, and any other reaper's of the suite: the mpi peer's). A forked child
# (multiprocessing) must not keep one open, or the reaper would not see EOF when the creator dies.
REAPER_PIPES: set[int] = set()


def _forget_reaper_pipes() -> None:
    for fd in REAPER_PIPES:
        with contextlib.suppress(OSError):
            os.close(fd)
    REAPER_PIPES.clear()


os.register_at_fork(after_in_child=_forget_reaper_pipes)


def spawn_reaper(argv: list[str], **popen: object) -> tuple[subprocess.Popen, int]:
    """Start a reaper (``argv``) in a session of its own, reading a pipe whose write end this process keeps (and
    registers in :data:`REAPER_PIPES`): the reaper sees EOF when this process dies. Returns it and the write end."""
    read_end, write_end = os.pipe()
    try:
        process = subprocess.Popen(argv, stdin=read_end, start_new_session=True, **popen)
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    REAPER_PIPES.add(write_end)
    return process, write_end


class Reaper:
    """A process that removes ``namespaces`` (killing what runs inside) and ``directories`` if their creator dies.

    ``start()`` it before making them; ``release(clean=True)`` once they are gone (it exits), or
    ``release(clean=False)`` when tearing down failed (it tries once more, then exits). Either way it is
    waited for: no process of it is left, not even a zombie.
    """

    def __init__(self, namespaces: list[str] = (), directories: list[str] = ()) -> None:
        self.namespaces = list(namespaces)
        self.directories = list(directories)
        self._process: subprocess.Popen | None = None
        self._pipe: int | None = None

    def start(self) -> Reaper:
        dirs = [arg for path in self.directories for arg in ("--dir", os.path.abspath(path))]
        # -I: the reaper needs only the standard library, and must not import this package (or
        # anything next to this file) that may be slow or broken.
        self._process, self._pipe = spawn_reaper([sys.executable, "-I", os.path.abspath(__file__), "reap", *dirs,
                                                  *self.namespaces], stdout=subprocess.DEVNULL)
        return self

    def release(self, clean: bool) -> None:
        if self._pipe is not None:
            REAPER_PIPES.discard(self._pipe)
            with contextlib.suppress(OSError):  # the reaper may be gone already
                if clean:
                    os.write(self._pipe, _CLOSED)
            os.close(self._pipe)
            self._pipe = None
        if self._process is not None:
            try:
                self._process.wait(timeout=_REAPER_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None


class EmulatedHosts:
    """``hosts`` network namespaces joined by veth pairs to a bridge, links shaped to ``link_rate_bps``.

    ``create()`` builds the network (or use ``with EmulatedHosts(...) as hosts:``); ``command()`` gives
    the argv prefix that runs a program inside a host; ``close()`` kills what still runs inside and
    deletes everything. Only the creating process tears down: in a forked child ``close()`` does nothing.
    ``prefix`` is common to all the run's namespaces, ``switch`` names the one holding the bridge.
    """

    INTERFACE = "tb0"

    def __init__(self, hosts: int, link_rate_bps: int | None = None) -> None:
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be between 1 and {MAX_HOSTS}, not {hosts}")
        if link_rate_bps is not None and link_rate_bps < 1000:
            raise ValueError(f"link rate {link_rate_bps} bit/s is too slow to shape: give at least 1kbit")
        self.hosts = hosts
        self.link_rate_bps = link_rate_bps
        self.prefix = f"{NAME_PREFIX}-{os.getpid()}-{secrets.token_hex(4)}"
        self.switch = f"{self.prefix}-sw"
        self._owner_pid = os.getpid()
        self._reaper: Reaper | None = None
        self._created = False
        self._closed = False

    def __enter__(self) -> EmulatedHosts:
        if not self._created:
            self.create()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def namespaces(self) -> list[str]:
        """Every namespace of these hosts: the hosts, then the switch."""
        return [self.namespace(host) for host in range(self.hosts)] + [self.switch]

    def namespace(self, host: int) -> str:
        """The name of host ``host``'s network namespace."""
        return f"{self.prefix}-h{self._check(host)}"

    def address(self, host: int) -> str:
        """Host ``host``'s IPv4 address on its link (no mask)."""
        return f"{SUBNET}.{self._check(host) + 1}"

    def command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``host``: ``["ip", "netns", "exec", namespace, *argv]``."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def create(self) -> EmulatedHosts:
        """Build the namespaces, the bridge, the links and their shaping; start the reaper. Returns self.

        A failing command raises :class:`CommandError`, after what was built is torn down.
        """
        if self._created:
            raise RuntimeError(f"emulated hosts {self.prefix} were already created")
        self._created = True
        self._reaper = Reaper(namespaces=self.namespaces()).start()
        try:
            self._build()
        except BaseException:
            # The reaper cleans up if this teardown fails too; the build error is the one to report.
            with contextlib.suppress(Exception):
                self.close()
            raise
        return self

    def _build(self) -> None:
        switch = self.switch
        _run(["ip", "netns", "add", switch])
        _run(["ip", "-n", switch, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", switch, "link", "set", BRIDGE, "up"])
        for host in range(self.hosts):
            ns, port = self.namespace(host), f"p{host}"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            veth = ["type", "veth", "peer", "name", port, "netns", switch]
            _run(["ip", "link", "add", self.INTERFACE, "netns", ns, *veth])
            _run(["ip", "-n", switch, "link", "set", port, "master", BRIDGE])
            _run(["ip", "-n", switch, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", self.INTERFACE])
            _run(["ip", "-n", ns, "link", "set", self.INTERFACE, "up"])
            if self.link_rate_bps is not None:
                burst, limit = tbf_parameters(self.link_rate_bps)
                shape = ["root", "tbf", "rate", f"{self.link_rate_bps}bit", "burst", str(burst), "limit", str(limit)]
                _run(["tc", "-n", ns, "qdisc", "add", "dev", self.INTERFACE, *shape])
                _run(["tc", "-n", switch, "qdisc", "add", "dev", port, *shape])

    def link_bytes(self, host: int) -> tuple[int, int]:
        """(tx, rx) bytes counted on host ``host``'s link (its ``tb0``) so far."""
        out = _run(["ip", "-j", "-s", "-n", self.namespace(host), "link", "show", "dev", self.INTERFACE])
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def describe(self) -> dict:
        """What a results file should record about the emulated network."""
        qdisc: dict | None = None
        if self.link_rate_bps is not None:
            burst, limit = tbf_parameters(self.link_rate_bps)
            qdisc = {
                "kind": "tbf",
                "burst_bytes": burst,
                "limit_bytes": limit,
                "where": f"egress of {self.INTERFACE} in each host and of its bridge port in the switch",
            }
        return {
            "hosts": self.hosts,
            "addresses": [self.address(host) for host in range(self.hosts)],
            "subnet": f"{SUBNET}.0/24",
            "interface": self.INTERFACE,
            "link_rate_bps": self.link_rate_bps,
            "qdisc": qdisc,
            "namespace_prefix": self.prefix,
        }

    def close(self) -> None:
        """Kill every process still inside the namespaces and delete them; stop the reaper. Idempotent."""
        if self._closed or not self._created or os.getpid() != self._owner_pid:
            return
        self._closed = True
        try:
            _teardown(self.namespaces())
        except BaseException:
            # Closing the pipe without "closed" makes the reaper try once more, then exit.
            self._reaper.release(clean=False)
            raise
        self._reaper.release(clean=True)

    def _check(self, host: int) -> int:
        if not 0 <= host < self.hosts:
            raise ValueError(f"host {host} out of range: these emulated hosts are 0..{self.hosts - 1}")
        return host


def _owner_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"  # a zombie is dead, it just has not been waited for


def sweep_stale() -> list[str]:
    """Delete the namespaces of emulated hosts whose creating process is dead (a crashed run); return them."""
    try:
        names = sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []
    stale = [name for name in names if (match := _NAME.match(name)) and not _owner_alive(int(match[1]))]
    _teardown(stale)
    return stale


def _reap(args: list[str]) -> int:
    """The reaper: wait for the creator to close its end of the pipe; unless it said so, tear down."""
    directories = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--dir"]
    names = [arg for i, arg in enumerate(args) if arg != "--dir" and (i == 0 or args[i - 1] != "--dir")]
    if sys.stdin.buffer.read() == _CLOSED:  # blocks until the creator closed the pipe or died
        return 0
    status = 0
    try:
        _teardown(names)
    except Exception as exc:
        print(f"bench.launch.hosts reaper: {exc}", file=sys.stderr)
        status = 1
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
    return status


def main(argv: list[str]) -> int:
    """``reap NAMES...`` (started by ``create()``) or ``sweep`` (prints the stale namespaces it removed)."""
    if argv[:1] == ["reap"]:
        return _reap(argv[1:])
    if argv == ["sweep"]:
        for name in sweep_stale():
            print(name)
        return 0
    print("usage: hosts.py reap [--dir PATH]... NAMESPACE... | hosts.py sweep", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
