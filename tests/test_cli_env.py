"""What the machine around bench hands it: the NVIDIA driver's library (a partial or fake ``libcuda.so.1``), the
command's version, where to look after a usage error, and where ranks on other hosts must listen."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: generous for a busy machine: each command takes seconds
BOUND_S = 300

#: a libcuda.so.1 that starts and has a GPU, but lacks the functions that describe it
_PARTIAL = r"""
int cuDriverGetVersion(int *version) { *version = 12040; return 0; }
int cuInit(unsigned flags) { return 0; }
int cuDeviceGetCount(int *count) { *count = 1; return 0; }
int cuDeviceGet(int *device, int index) { *device = index; return 0; }
"""
#: a libcuda.so.1 that claims 2**31 - 1 devices whose name and PCI bus id carry terminal escapes; a probe that asks
#: about more than a thousand of them is killed (abort), as it would otherwise run for hours and take gigabytes
_MANY = r"""
#include <stdlib.h>
#include <string.h>
#include <stddef.h>
static int asked;
int cuDriverGetVersion(int *version) { *version = 12040; return 0; }
int cuInit(unsigned flags) { return 0; }
int cuDeviceGetCount(int *count) { *count = 2147483647; return 0; }
int cuDeviceGet(int *device, int index) { if (++asked > 1000) abort(); *device = index; return 0; }
int cuDeviceGetName(char *name, int length, int device) { strncpy(name, "Fake\x1b[31mGPU\n", length); return 0; }
int cuDeviceTotalMem_v2(size_t *bytes, int device) { *bytes = (size_t)16 << 30; return 0; }
int cuDeviceGetPCIBusId(char *bus, int length, int device) {
    strncpy(bus, "0000:01:00.0\x1b]0;owned\x07", length); return 0;
}
"""

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="building a fake libcuda.so.1 needs a C compiler (cc)")


def _fake_driver(directory: Path, source: str) -> Path:
    """A directory holding ``libcuda.so.1`` built from ``source``."""
    directory.mkdir()
    (directory / "fake.c").write_text(source)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(directory / "libcuda.so.1"), str(directory / "fake.c")],
                   check=True, timeout=BOUND_S)
    return directory


def bench(*args: str, driver: Path | None = None) -> subprocess.CompletedProcess:
    """``bench ARGS`` (its output as bytes decoded, so that a raw escape byte shows), with ``driver``'s
    ``libcuda.so.1`` the one it loads."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    if driver is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([str(driver), *filter(None, [env.get("LD_LIBRARY_PATH")])])
    done = subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True, timeout=BOUND_S,
                          cwd=ROOT, env=env)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(errors="replace"),
                                       done.stderr.decode(errors="replace"))


def _micro_cuda(out: Path) -> list[str]:
    return ["micro", "--memory", "cuda", "--sizes", "1KB", "--transports", "local", "--no-references", "--no-peers",
            "--no-plot", "--out", str(out)]


@needs_cc
def test_a_libcuda_missing_a_function_is_an_unusable_driver_in_one_line(tmp_path):
    """It used to end bench info, bench doctor and bench micro --memory cuda with a traceback (AttributeError:
    undefined symbol: cuDeviceGetName), exit 1."""
    driver = _fake_driver(tmp_path / "partial", _PARTIAL)
    unusable = f"the NVIDIA driver is unusable: {driver / 'libcuda.so.1'} has no cuDeviceGetName"

    info = bench("info", driver=driver)
    assert info.returncode == 0 and "Traceback" not in info.stdout + info.stderr, info.stderr[-3000:]
    assert f"  none: {unusable}" in "\n".join(info.stdout.splitlines())

    doctor = bench("doctor", driver=driver)
    assert "Traceback" not in doctor.stdout + doctor.stderr, doctor.stderr[-3000:]
    [gpu] = [line for line in doctor.stdout.splitlines() if re.match(r"\s+\w+\s+gpu\s", line)]
    assert gpu.split()[0] == "skip" and unusable in gpu
    assert doctor.stdout.splitlines()[-1].startswith(("ready for", "not ready for"))

    micro = bench(*_micro_cuda(tmp_path / "run"), driver=driver)
    assert micro.returncode == 2, micro.stderr[-3000:]
    [line] = micro.stderr.splitlines()
    assert line.startswith("bench micro: error: --memory cuda:0: ") and unusable in line
    assert not (tmp_path / "run").exists()


@needs_cc
def test_a_libcuda_claiming_two_billion_devices_is_asked_about_64_and_its_text_is_escaped(tmp_path):
    """It used to be asked about every one of 2**31 - 1 devices (past 60 s, 4.3 GB), and the escapes in a device's
    name and PCI bus id reached the terminal raw."""
    driver = _fake_driver(tmp_path / "many", _MANY)

    info = bench("info", driver=driver)
    assert info.returncode == 0 and "Traceback" not in info.stdout + info.stderr, info.stderr[-3000:]
    assert "\x1b" not in info.stdout + info.stderr and "\x07" not in info.stdout
    devices = [line.strip() for line in info.stdout.splitlines() if re.match(r"\s+cuda:\d+ ", line)]
    assert len(devices) == 64
    assert devices[0] == r"cuda:0 Fake\x1b[31mGPU\x0a, 16.0 GiB, PCI 0000:01:00.0\x1b]0;owned\x07"
    assert devices[-1].startswith("cuda:63 ")
    assert "  the driver claims 2147483647 devices: the first 64 are listed" in info.stdout.splitlines()

    doctor = bench("doctor", driver=driver)
    assert "Traceback" not in doctor.stdout + doctor.stderr, doctor.stderr[-3000:]
    assert "\x1b" not in doctor.stdout + doctor.stderr
    [gpu] = [line for line in doctor.stdout.splitlines() if re.match(r"\s+\w+\s+gpu\s", line)]
    assert "cuda:63 " in gpu and "cuda:64 " not in gpu and "the driver claims 2147483647 devices" in gpu

    micro = bench(*_micro_cuda(tmp_path / "run"), driver=driver)
    assert "Traceback" not in micro.stdout + micro.stderr and micro.returncode != -6, micro.stderr[-3000:]
    if importlib.util.find_spec("cupy") is None:  # with CuPy the run would go on to the fake device
        assert micro.returncode == 2
        [line] = micro.stderr.splitlines()
        assert line.startswith("bench micro: error: --memory cuda:0: device memory needs CuPy")


def test_driver_text_keeps_printable_ascii_and_escapes_every_other_byte():
    from transports.memory import driver_text

    assert driver_text(b"NVIDIA H100 80GB HBM3") == "NVIDIA H100 80GB HBM3"
    assert driver_text(b"0000:01:00.0\x1b[2J\n\xff\x7f") == r"0000:01:00.0\x1b[2J\x0a\xff\x7f"
    assert driver_text(bytes(range(256))).isascii() and driver_text(bytes(range(256))).isprintable()


def test_bench_version_prints_the_package_version_and_the_commit_of_a_checkout():
    """There was no ``bench --version``."""
    done = bench("--version")
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    version = importlib.metadata.version("tensor-transport-bench")
    assert line.startswith(f"bench {version} (tensor-transport-bench")
    if (ROOT / ".git").exists() and shutil.which("git"):
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=BOUND_S).stdout.strip()
        assert line == f"bench {version} (tensor-transport-bench, commit {head})"


@pytest.mark.parametrize("command", [["micro"], ["model", "fcn5"], ["report", "results"], ["doctor"]])
def test_an_unknown_option_of_a_command_points_at_that_commands_help(command):
    """It pointed at ``bench --help``, which does not list a command's options."""
    done = bench(*command, "--bogus", "x")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"bench {command[0]}: error: unrecognized arguments: --bogus x (see 'bench {command[0]} --help')"]


def test_an_unknown_option_before_the_command_points_at_benchs_help():
    done = bench("--bogus", "micro")
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["bench: error: unrecognized arguments: --bogus (see 'bench --help')"]


def test_bind_says_ranks_on_other_hosts_need_a_non_loopback_address_of_this_host(monkeypatch):
    """Its help said only "default: loopback", and ranks spanning hosts were left listening on loopback (given, or
    the 127.0.1.1 that Debian's /etc/hosts gives the host's name), where the other hosts cannot reach them."""
    import socket

    from bench.launch.addresses import resolve_bind
    from bench.launch.messages import LaunchError
    from bench.options import add_launch_options

    parser = argparse.ArgumentParser(prog="bench micro")
    add_launch_options(parser)
    assert "must be a non-loopback address of this host" in " ".join(parser.format_help().split())

    assert resolve_bind("127.0.0.1", ["node1"]) == "127.0.0.1"  # one host: loopback is right
    assert resolve_bind(None, ["node1", "node1"]) == "127.0.0.1"
    with pytest.raises(LaunchError, match=r"^the ranks span 2 hosts, and --bind 127\.0\.0\.1 is a loopback address "
                       r"the others cannot reach: choose where ranks listen with --bind ADDRESS\|INTERFACE, a "
                       r"non-loopback address \(or interface\) of this host that the other hosts reach \(here: .*lo "
                       r"127\.0\.0\.1"):
        resolve_bind("127.0.0.1", ["node1", "node2"])
    with pytest.raises(LaunchError, match="--bind lo is a loopback address the others cannot reach"):
        resolve_bind("lo", ["node1", "node2"])
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    with pytest.raises(LaunchError, match=r"resolves to 127\.0\.1\.1, which is a loopback address .* a non-loopback "
                       "address"):
        resolve_bind(None, ["node1", "node2"])

    def unresolvable(name: str) -> str:
        raise socket.gaierror("Name or service not known")

    monkeypatch.setattr(socket, "gethostbyname", unresolvable)
    with pytest.raises(LaunchError, match=r"does not resolve .*--bind ADDRESS\|INTERFACE, a non-loopback address"):
        resolve_bind(None, ["node1", "node2"])
