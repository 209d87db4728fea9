"""bench doctor, the RDMA devices read from sysfs, and the refusal of runs that would leave an RDMA port unused.

The sysfs trees here are fakes written into tmp_path, laid out as the kernel lays out ``/sys/class/infiniband``
(the rxe0 one is a copy of Soft-RoCE's in the QEMU guest of ``tools/softroce``); ``TENSOR_BENCH_RDMA_SYSFS``
points the commands at them.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from bench.experiments import doctor
from bench.experiments.doctor import Check, Needs, exit_status, format_checks, memlock_check, rdma_checks
from bench.options import choose, fabric_problem
from transports.fabric import rdma_devices
from transports.fabric.rdma_devices import SYSFS_VARIABLE, active_mtu, gid_choice, missing_reason, read_devices
from transports.fabric.settings import RdmaSettings

EMPTY_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
RXE0_GIDS = {0: ("fe80:0000:0000:0000:5054:00ff:fe12:3456", "RoCE v2", "eth0"),
             1: ("0000:0000:0000:0000:0000:ffff:0a00:020f", "RoCE v2", "eth0")}
VERBS = Needs.of("verbs", "auto")
UCX_AUTO = Needs.of("ucx", "auto")


def write_device(root: Path, name: str, *, node_desc: str = "rxe", parent: str | None = "eth0",
                 state: str = "4: ACTIVE", phys_state: str = "5: LinkUp", link_layer: str = "Ethernet",
                 lid: str = "0x0", rate: str = "2.5 Gb/sec (1X SDR)",
                 gids: dict[int, tuple[str, str | None, str | None]] | None = None, table: int = 4,
                 netdev_mtu: int | None = 1500) -> Path:
    """A device as sysfs shows it: ``gids`` index -> (GID, type, netdev); the other entries of a ``table``-long
    GID table are empty and refuse reads of their type and netdev, as the kernel's do."""
    device = root / name
    port = device / "ports" / "1"
    for directory in (port / "gids", port / "gid_attrs" / "types", port / "gid_attrs" / "ndevs"):
        directory.mkdir(parents=True)
    (device / "node_desc").write_text(f"{node_desc}\n")
    (device / "node_type").write_text("1: CA\n")
    (device / "node_guid").write_text("5054:00ff:fe12:3456\n")
    (device / "fw_ver").write_text("\n")
    if parent is not None:
        (device / "parent").write_text(f"{parent}\n")
    for field, value in (("state", state), ("phys_state", phys_state), ("link_layer", link_layer), ("lid", lid),
                         ("rate", rate), ("cap_mask", "0x00010000")):
        (port / field).write_text(f"{value}\n")
    gids = RXE0_GIDS if gids is None else gids
    for index in range(table):
        gid, kind, netdev = gids.get(index, (EMPTY_GID, None, None))
        (port / "gids" / str(index)).write_text(f"{gid}\n")
        # an empty entry's type and netdev cannot be read (EINVAL): a directory in their place fails the read too
        for attribute, value in (("types", kind), ("ndevs", netdev)):
            target = port / "gid_attrs" / attribute / str(index)
            target.write_text(f"{value}\n") if value is not None else target.mkdir()
    if netdev_mtu is not None and parent is not None:
        (root.parent / "net" / parent).mkdir(parents=True, exist_ok=True)
        (root.parent / "net" / parent / "mtu").write_text(f"{netdev_mtu}\n")
    return device


@pytest.fixture
def sysfs(tmp_path) -> Path:
    """An empty ``class/infiniband`` directory (``class/net`` beside it)."""
    root = tmp_path / "class" / "infiniband"
    root.mkdir(parents=True)
    return root


def bench(*args: str, sysfs_root: Path | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    if sysfs_root is not None:
        env[SYSFS_VARIABLE] = str(sysfs_root)
    return subprocess.run([sys.executable, "-m", "bench.cli", *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd)


def lines(checks: list[Check], name: str) -> list[Check]:
    return [check for check in checks if check.name == name]


# -- reading sysfs -------------------------------------------------------------------------------------------


def test_the_soft_roce_device_of_the_guest_reads_as_ibv_devinfo_shows_it(sysfs):
    write_device(sysfs, "rxe0", table=1024)
    [device] = read_devices(sysfs)
    assert (device.name, device.node_desc, device.software, device.kind) == ("rxe0", "rxe", True, "Soft-RoCE")
    [port] = device.ports
    assert (port.name, port.active, port.state_name, port.phys_state) == ("rxe0:1", True, "ACTIVE", "LinkUp")
    assert (port.link_layer, port.kind, port.lid, port.rate) == ("Ethernet", "RoCE", 0, "2.5 Gb/sec (1X SDR)")
    assert [(gid.index, gid.text, gid.type, gid.netdev) for gid in port.gids] == [
        (0, "fe80::5054:ff:fe12:3456", "RoCE v2", "eth0"), (1, "::ffff:10.0.2.15", "RoCE v2", "eth0")]
    assert (port.netdev, port.netdev_mtu, port.active_mtu) == ("eth0", 1500, 1024)
    # the GID index a verbs run takes: the RoCE v2 entry holding an IPv4 address
    choice = gid_choice([device])
    assert (choice.device, choice.port, choice.gid_index, choice.mtu) == ("rxe0", 1, 1, 1024)


def test_active_mtu_follows_the_interface_mtu_less_the_roce_headers():
    assert [active_mtu(mtu) for mtu in (1500, 9000, 4200, 2100, 576, 100)] == [1024, 4096, 4096, 1024, 256, 256]


def test_no_tree_and_an_empty_tree_say_why_there_is_no_device(tmp_path, sysfs):
    modules = tmp_path / "modules"
    modules.write_text("")
    assert missing_reason(tmp_path / "nope", modules) == f"{tmp_path / 'nope'} does not exist (no RDMA driver loaded)"
    # a kernel that loads no modules (this project's development machine): nothing to modprobe
    no_modules = missing_reason(tmp_path / "nope", tmp_path / "no-modules")
    assert "no RDMA support built in and cannot load a driver" in no_modules
    [check] = rdma_checks([], no_modules, RdmaSettings(), VERBS)
    assert "tools/softroce" in check.fix and "modprobe" not in check.fix
    assert read_devices(tmp_path / "nope") == []
    assert "is empty" in missing_reason(sysfs)
    write_device(sysfs, "rxe0")
    assert missing_reason(sysfs) is None


def test_the_variable_points_the_reader_at_another_tree(sysfs):
    assert str(rdma_devices.sysfs_root({})) == "/sys/class/infiniband"
    assert rdma_devices.sysfs_root({SYSFS_VARIABLE: str(sysfs)}) == sysfs


# -- the checks ------------------------------------------------------------------------------------------------


def test_the_rxe0_tree_is_ready_for_verbs(sysfs):
    write_device(sysfs, "rxe0")
    checks = rdma_checks(read_devices(sysfs), None, RdmaSettings(), VERBS)
    [port] = checks
    assert port.state == "ok", port
    for fragment in ("rxe0:1 (Soft-RoCE, on eth0): ACTIVE, LinkUp, RoCE", "active MTU 1024",
                     "GID index 1 (RoCE v2 ::ffff:10.0.2.15)", "--fabric verbs uses it"):
        assert fragment in port.finding
    assert exit_status(checks) == 0
    # RDMA_GID_INDEX picks another entry, as it would in a run
    [port] = rdma_checks(read_devices(sysfs), None, RdmaSettings(gid_index=0), VERBS)
    assert "GID index 0 (RoCE v2 fe80::5054:ff:fe12:3456)" in port.finding


def test_no_device_fails_verbs_warns_ucx_and_is_skipped_without_rdma(tmp_path):
    (tmp_path / "modules").write_text("")
    reason = missing_reason(tmp_path / "nope", tmp_path / "modules")
    for needs, state in ((VERBS, "fail"), (UCX_AUTO, "warn"), (Needs.of("ucx", "shm"), "skip")):
        [check] = rdma_checks([], reason, RdmaSettings(), needs)
        assert (check.state, check.finding) == (state, f"none: {reason}")
        assert "rdma link add rxe0 type rxe" in check.fix
    assert exit_status(rdma_checks([], reason, RdmaSettings(), VERBS)) == 1


def test_a_port_down_fails_unless_another_port_is_up(sysfs):
    write_device(sysfs, "mlx5_0", node_desc="host1 HCA-1", parent="ens1f0", state="1: DOWN", phys_state="3: Disabled",
                 gids={})
    [down] = rdma_checks(read_devices(sysfs), None, RdmaSettings(), VERBS)
    assert down.state == "fail"
    assert down.finding.startswith("mlx5_0:1 (on ens1f0): DOWN, Disabled, RoCE")
    assert "ip link set ens1f0 up" in down.fix
    assert "rdma choice" not in [check.name for check in rdma_checks(read_devices(sysfs), None, RdmaSettings(), VERBS)]
    # another device with an active port carries the run: the port down is only a warning
    write_device(sysfs, "rxe0")
    checks = rdma_checks(read_devices(sysfs), None, RdmaSettings(), VERBS)
    assert [check.state for check in checks] == ["warn", "ok"]
    assert exit_status(checks) == 0
    # ucx does not need the port: a warning, whatever the rest
    [alone] = rdma_checks(read_devices(sysfs)[:1], None, RdmaSettings(), UCX_AUTO)
    assert alone.state == "warn"


def test_a_roce_port_without_a_gid_fails_naming_the_interface_to_address(sysfs):
    write_device(sysfs, "rxe0", gids={})
    [port] = read_devices(sysfs)[0].ports
    assert port.gids == () and port.active
    [check] = rdma_checks(read_devices(sysfs), None, RdmaSettings(), VERBS)
    assert check.state == "fail"
    assert "rxe0 port 1 (RoCE) has no GID" in check.finding
    assert "ip addr add ADDRESS/PREFIX dev eth0" in check.fix and "RDMA_GID_INDEX" in check.fix
    # what a run would say: the same choose() of verbs/decide.py
    assert "has no GID" in gid_choice(read_devices(sysfs))


def test_an_infiniband_port_routes_by_lid_and_its_mtu_is_not_in_sysfs(sysfs):
    write_device(sysfs, "mlx5_1", node_desc="host1 HCA-2", parent=None, link_layer="InfiniBand", lid="0x5",
                 rate="100 Gb/sec (4X EDR)", gids={0: ("fe80:0000:0000:0000:0002:c903:00f1:2345", "IB/RoCE v1", None)})
    [device] = read_devices(sysfs)
    assert (device.software, device.kind) == (False, "hardware")
    [port] = device.ports
    assert (port.kind, port.lid, port.netdev, port.active_mtu) == ("InfiniBand", 5, None, None)
    assert [(gid.index, gid.type) for gid in port.gids] == [(0, "IB")]
    [check] = rdma_checks([device], None, RdmaSettings(), VERBS)
    assert check.state == "ok", check
    for fragment in ("mlx5_1:1: ACTIVE, LinkUp, InfiniBand", "active MTU unknown (InfiniBand", "LID 0x5",
                     "LID routing", "--fabric verbs uses it"):
        assert fragment in check.finding
    # waiting for a subnet manager: the link is up, the port is not
    write_device(sysfs, "mlx5_2", node_desc="host1 HCA-3", parent=None, link_layer="InfiniBand", state="2: INIT")
    down = rdma_checks(read_devices(sysfs), None, RdmaSettings(), VERBS)[1]
    assert down.state == "warn" and "opensm" in down.fix


def test_a_bad_rdma_variable_fails_verbs_naming_it(sysfs):
    write_device(sysfs, "rxe0")
    checks = rdma_checks(read_devices(sysfs), None, RdmaSettings(device="mlx5_9"), VERBS)
    assert [check.state for check in checks] == ["ok", "fail"]
    assert "RDMA_DEVICE=mlx5_9 is not one of the RDMA devices here: rxe0" in checks[1].finding
    checks = rdma_checks(read_devices(sysfs), None, "RDMA_GID_INDEX=x is not a whole number", VERBS)
    assert checks[0].state == "fail" and checks[0].finding.startswith("RDMA_GID_INDEX=x")


def test_a_low_locked_memory_limit_fails_a_fabric_that_registers(sysfs):
    gib = 1 << 30
    low = memlock_check(64 << 10, 64 << 10, 0, 3 * gib, needed=True)
    assert low.state == "fail"
    assert "limit 64 KB (hard 64 KB): a run registers up to 3 GB" in low.finding
    assert "ulimit -l unlimited" in low.fix and "LimitMEMLOCK=infinity" in low.fix
    assert exit_status([low]) == 1
    # a hard limit that allows enough: raise the soft one to what the run needs (in KB)
    assert "ulimit -l 3145728 (the hard limit allows it)" in memlock_check(64 << 10, 4 * gib, 0, 3 * gib, True).fix
    # not needed (no RDMA in use): a warning
    assert memlock_check(64 << 10, 64 << 10, 0, 3 * gib, needed=False).state == "warn"
    # enough, unlimited, or lifted by CAP_IPC_LOCK (bit 14 of CapEff)
    assert memlock_check(4 * gib, 4 * gib, 0, 3 * gib, True).state == "ok"
    assert memlock_check(resource.RLIM_INFINITY, resource.RLIM_INFINITY, 0, 3 * gib, True).state == "ok"
    lifted = memlock_check(64 << 10, 64 << 10, doctor.capabilities("CapEff:\t0000000000004000\n"), 3 * gib, True)
    assert lifted.state == "ok" and "CAP_IPC_LOCK" in lifted.finding
    assert doctor.capabilities("CapEff:\t000001fffeffbfff\n") >> doctor.CAP_IPC_LOCK & 1 == 0


def test_huge_pages_ptrace_and_shm_lines():
    assert doctor.hugepage_check("always [madvise] never\n", "HugePages_Total:       0\nHugepagesize:    2048 kB\n") \
        == Check("huge pages", "ok", "transparent huge pages: madvise; reserved huge pages: 0 x 2 MB")
    never = doctor.hugepage_check("always madvise [never]\n", None)
    assert never.state == "warn" and "echo madvise" in never.fix
    assert doctor.ptrace_check("0\n", True).state == "ok"
    assert doctor.ptrace_check(None, True).state == "ok"
    restricted = doctor.ptrace_check("1\n", True)
    assert restricted.state == "warn" and "kernel.yama.ptrace_scope=0" in restricted.fix
    assert doctor.ptrace_check("1\n", False).state == "skip"
    gib = 1 << 30
    assert doctor.shm_check(64 << 20, 64 << 20, 3 * gib, UCX_AUTO).fix.startswith("mount -o remount,size=3G /dev/shm")
    assert doctor.shm_check(None, None, 3 * gib, UCX_AUTO).state == "fail"
    assert doctor.shm_check(None, None, 3 * gib, VERBS).state == "skip"


def test_ucx_without_a_transport_on_an_active_port_fails_the_ucx_fabric(sysfs):
    write_device(sysfs, "rxe0")
    ports = rdma_devices.active_ports(read_devices(sysfs))
    wheel = doctor.Library("1.22.0", "libucx-cu12 wheel", {"tcp": ["eth0", "lo"], "cma": ["memory"]},
                           ("--without-verbs",))
    check = doctor.ucx_check(None, wheel, ports, [], UCX_AUTO)
    assert check.state == "fail"
    assert check.finding == "UCX 1.22.0 (libucx-cu12 wheel, --without-verbs: tcp, cma); reaches none of rxe0:1"
    assert "--fabric verbs" in check.fix and "TENSOR_BENCH_UCX_HOME=/usr" in check.fix
    assert doctor.ucx_check(None, wheel, ports, [], Needs.of("ucx", "tcp")).state == "ok"
    assert doctor.ucx_check(None, wheel, ports, [], VERBS).state == "skip"
    system = doctor.Library("1.13.1", "TENSOR_BENCH_UCX_HOME=/usr", {"rc_verbs": ["rxe0:1"]})
    assert doctor.ucx_check(None, system, ports, ["rc_verbs/rxe0:1"], UCX_AUTO).state == "ok"


def test_the_moved_ucx_info_parser_reads_the_guests_system_ucx():
    from transports.fabric.ucx.device import parse_ucx_info

    text = "\n".join(["# Memory domain: rxe0", "#     Component: ib", "#      Transport: rc_verbs",
                      "#         Device: rxe0:1", "#      Transport: ud_verbs", "#         Device: rxe0:1",
                      "# Memory domain: tcp", "#      Transport: tcp", "#         Device: lo",
                      "#      Transport: tcp", "#         Device: eth0"])
    assert parse_ucx_info(text) == {"rc_verbs": ["rxe0:1"], "ud_verbs": ["rxe0:1"], "tcp": ["lo", "eth0"]}


def test_the_table_shows_the_fix_only_when_not_ok():
    shown = format_checks([Check("rdma", "fail", "none", "load a driver"), Check("huge pages", "ok", "madvise", "x")])
    assert shown == ["fail  rdma        none  -> fix: load a driver", "ok    huge pages  madvise"]


def test_diagnose_reads_the_paths_it_is_given(tmp_path, sysfs):
    write_device(sysfs, "rxe0", state="1: DOWN", phys_state="3: Disabled")
    (tmp_path / "thp").write_text("always madvise [never]\n")
    (tmp_path / "meminfo").write_text("HugePages_Total:      16\nHugepagesize:    1048576 kB\n")
    (tmp_path / "ptrace").write_text("1\n")
    (tmp_path / "status").write_text("Name:\tpython\nCapEff:\t0000000000000000\n")
    paths = doctor.Paths(rdma=sysfs, thp=tmp_path / "thp", meminfo=tmp_path / "meminfo", ptrace=tmp_path / "ptrace",
                         status=tmp_path / "status", shm=tmp_path / "no-shm")
    verbs = {check.name: check for check in doctor.diagnose("verbs", "auto", 1 << 30, paths)}
    assert verbs["rdma port"].state == "fail" and verbs["rdma port"].finding.startswith("rxe0:1 (Soft-RoCE, on eth0)")
    assert verbs["huge pages"] == Check("huge pages", "warn", "transparent huge pages: never; reserved huge pages: "
                                        "16 x 1 GB", "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled "
                                        "(as root)")
    assert (verbs["ptrace scope"].state, verbs["/dev/shm"].state, verbs["ucx"].state) == ("skip", "skip", "skip")
    ucx = {check.name: check for check in doctor.diagnose("ucx", "shm", 1 << 30, paths)}
    assert ucx["rdma port"].state == "skip"  # shm asks for no RDMA
    assert ucx["ptrace scope"].state == "warn" and ucx["/dev/shm"].state == "fail"
    assert exit_status(list(ucx.values())) == 1


# -- the commands ----------------------------------------------------------------------------------------------


def test_doctor_without_rdma_says_so_and_fails_only_for_verbs(tmp_path):
    absent = tmp_path / "class" / "infiniband"
    ucx = bench("doctor", sysfs_root=absent)
    # why (no driver loaded, or a kernel that loads none) depends on the machine
    assert f"none: {absent} does not exist" in ucx.stdout, ucx.stdout
    verbs = bench("doctor", "--fabric", "verbs", sysfs_root=absent)
    assert verbs.returncode == 1, verbs.stdout + verbs.stderr
    assert "fail  rdma" in verbs.stdout and "not ready for --fabric verbs" in verbs.stdout
    from transports import fabric

    if fabric.availability("ucx").ok:
        assert ucx.returncode == 0, ucx.stdout + ucx.stderr
        assert "ready for --fabric ucx" in ucx.stdout


def test_doctor_reports_the_fake_rxe0_and_a_bad_memory_is_a_usage_error(sysfs):
    write_device(sysfs, "rxe0")
    result = bench("doctor", "--fabric", "verbs", "--memory", "1GB", sysfs_root=sysfs)
    assert "ok    rdma port" in result.stdout and "GID index 1" in result.stdout, result.stdout
    assert "a run registers up to 1 GB" in result.stdout
    bad = bench("doctor", "--memory", "lots")
    assert bad.returncode == 2 and "--memory: invalid size 'lots'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_info_lists_the_devices_of_a_fake_tree_and_what_reaches_them(tmp_path, sysfs):
    write_device(sysfs, "rxe0")
    shown = bench("info", sysfs_root=sysfs).stdout
    for fragment in ("RDMA devices:", "rxe0     Soft-RoCE, software (rxe)",
                     "port 1: ACTIVE (LinkUp), RoCE on eth0, active MTU 1024, 2.5 Gb/sec (1X SDR)",
                     "GIDs: 0 fe80::5054:ff:fe12:3456 RoCE v2; 1 ::ffff:10.0.2.15 RoCE v2", "--fabric ucx",
                     "--fabric verbs"):
        assert fragment in shown, shown
    assert "none:" not in shown.split("RDMA devices:")[1].split("GPUs")[0]
    absent = bench("info", sysfs_root=tmp_path / "nope").stdout
    assert f"none: {tmp_path / 'nope'} does not exist" in absent


def test_a_run_that_would_leave_an_active_rdma_port_unused_is_refused(tmp_path, sysfs):
    from transports import fabric

    if not fabric.availability("ucx").ok:
        pytest.skip(f"the ucx fabric cannot run here: {fabric.availability('ucx').reason}")
    write_device(sysfs, "rxe0")
    if fabric.backend("ucx").rdma_reach(["rxe0:1"]):
        pytest.skip("this machine's UCX lists rxe0:1")
    out = tmp_path / "run"
    result = bench("micro", "--sizes", "1KB", "--transports", "zerocopy", "--iters", "2", "--no-references",
                   "--no-peers",
                   "--no-plot", "--out", str(out), sysfs_root=sysfs, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("bench micro: error: --fabric ucx: this machine has an active RDMA port (rxe0:1, RoCE) "
                           "that the ucx fabric's UCX "), line
    for fix in ("use --fabric verbs", "TENSOR_BENCH_UCX_HOME=/usr pip install -e .",
                "--fabric-transport shm or tcp to run without RDMA"):
        assert fix in line
    assert not out.exists() and not (tmp_path / "results").exists()


def _args(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"fabric": "ucx", "fabric_transport": "auto", "launcher": "local", **given})


def test_the_refusal_is_only_for_auto_and_only_with_an_active_port(monkeypatch, tmp_path, sysfs):
    from transports import fabric

    if not fabric.availability("ucx").ok:
        pytest.skip(f"the ucx fabric cannot run here: {fabric.availability('ucx').reason}")
    write_device(sysfs, "rxe0")
    monkeypatch.setenv(SYSFS_VARIABLE, str(sysfs))
    reached = fabric.backend("ucx").rdma_reach(["rxe0:1"])
    problem = fabric_problem(_args())
    assert (problem is None) == bool(reached), problem
    for explicit in ("shm", "tcp"):
        assert fabric_problem(_args(fabric_transport=explicit)) is None
    assert fabric_problem(_args(launcher="netns")) is None  # netns runs tcp whatever is asked
    assert fabric_problem(_args(diagnoses_fabric=True)) is None
    # transports that use no fabric leave no RDMA port unused
    assert fabric_problem(_args(transports=[choose("grpc_tcp"), choose("local")])) is None
    assert (fabric_problem(_args(transports=[choose("grpc_tcp"), choose("zerocopy")])) is None) == bool(reached)
    # a port down, or no RDMA at all: nothing to leave unused
    write_device(tmp_path / "down" / "infiniband", "rxe0", state="1: DOWN", phys_state="3: Disabled")
    monkeypatch.setenv(SYSFS_VARIABLE, str(tmp_path / "down" / "infiniband"))
    assert fabric_problem(_args()) is None
    monkeypatch.setenv(SYSFS_VARIABLE, str(tmp_path / "nope"))
    assert fabric_problem(_args()) is None


def test_with_fabric_transport_shm_the_same_run_goes_ahead(tmp_path, sysfs):
    from transports import fabric

    if not fabric.availability("ucx").ok:
        pytest.skip(f"the ucx fabric cannot run here: {fabric.availability('ucx').reason}")
    write_device(sysfs, "rxe0")
    out = tmp_path / "run"
    result = bench("micro", "--sizes", "1KB", "--transports", "zerocopy", "--iters", "2", "--warmup", "0",
                   "--no-references", "--no-peers", "--no-plot", "--fabric-transport", "shm", "--out",
                   str(out), sysfs_root=sysfs,
                   cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (out / "records.csv").exists()


def test_verbs_reaches_nothing_it_cannot_list():
    from transports import fabric

    assert fabric.backend("verbs").rdma_reach([]) == []
    if fabric.availability("verbs").ok:
        pytest.skip("this machine has an RDMA device")
    assert fabric.backend("verbs").rdma_reach(["rxe0:1"]) == []


# -- GPUs: bench info's section, bench doctor's checks ---------------------------------------------------------


def _driver(gpus=1):
    from transports.memory import Driver, Gpu

    if not gpus:
        return Driver(None, (), "there is no NVIDIA driver here (libcuda.so.1 is not installed)")
    return Driver((13, 0), tuple(Gpu(i, "NVIDIA H100 80GB HBM3", 80 << 30, f"0000:0{i}:00.0") for i in range(gpus)),
                  None)


def _root(tmp_path, peermem=False, open_module=False):
    if peermem:
        (tmp_path / "sys/module/nvidia_peermem").mkdir(parents=True, exist_ok=True)
    version = tmp_path / "proc/driver/nvidia/version"
    version.parent.mkdir(parents=True, exist_ok=True)
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95\n" if open_module else
                       "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95\n")
    return tmp_path


@pytest.mark.parametrize(("peermem", "open_module", "kernel", "met"), [
    (True, False, "5.4.0", True),     # nvidia_peermem loaded
    (False, True, "6.8.0", True),     # dma-buf: a new kernel and NVIDIA's open module
    (False, True, "5.10.0", False),   # the open module on a kernel before dma-buf
    (False, False, "6.8.0", False),   # the proprietary module without nvidia_peermem
])
def test_gpudirect_needs_peer_memory_from_nvidia_peermem_or_dmabuf(tmp_path, peermem, open_module, kernel, met):
    from bench.experiments.gpus import gpudirect_prerequisites

    found = gpudirect_prerequisites(_driver(), ["mlx5_0:1"], True, _root(tmp_path, peermem, open_module), kernel)
    assert {p.name: p.met for p in found} == {"gpu": True, "rdma port": True, "peer memory": met, "ucx verbs": True}


def test_gpudirect_names_each_missing_prerequisite_and_its_fix(tmp_path):
    from bench.experiments.gpus import gpudirect_prerequisites

    found = gpudirect_prerequisites(_driver(0), [], False, _root(tmp_path), "6.8.0")
    assert not any(p.met for p in found)
    assert all(p.fix for p in found)
    assert "no NVIDIA driver" in found[0].finding and "no active RDMA port" in found[1].finding


def _facts(tmp_path, gpus=1, cupy_problem=None, ipc="works", ports=("mlx5_0:1",)):
    from bench.experiments.gpus import GpuFacts, gpudirect_prerequisites

    driver = _driver(gpus)
    return GpuFacts(driver, None if cupy_problem else "14.0.0", None if cupy_problem else "13.0", cupy_problem,
                    None, ("cuda_copy", "cuda_ipc") if gpus else (), ipc,
                    gpudirect_prerequisites(driver, list(ports), True, _root(tmp_path, peermem=True), "6.8.0"))


def test_without_a_gpu_the_gpu_line_is_skipped_and_says_cuda_is_refused(tmp_path):
    from bench.experiments.doctor import exit_status, gpu_checks

    checks = gpu_checks(_facts(tmp_path, gpus=0, ipc="not tried: no GPU"))
    assert [(c.name, c.state) for c in checks] == [("gpu", "skip")]
    assert "--memory cuda is refused" in checks[0].finding
    assert exit_status(checks) == 0


def test_a_gpu_with_everything_is_ok_on_every_line(tmp_path):
    from bench.experiments.doctor import gpu_checks

    checks = gpu_checks(_facts(tmp_path))
    assert [(c.name, c.state) for c in checks] == [("gpu", "ok"), ("cuda_ipc", "ok"), ("gpudirect", "ok")]
    assert "cuda:0 NVIDIA H100" in checks[0].finding and "CUDA 13.0" in checks[0].finding


def test_a_gpu_without_cupy_ipc_or_a_nic_warns_with_the_fixes(tmp_path):
    from bench.experiments.doctor import exit_status, gpu_checks

    checks = gpu_checks(_facts(tmp_path, cupy_problem="device memory needs CuPy", ipc="fails: no access",
                               ports=()))
    states = {c.name: c for c in checks}
    assert {name: c.state for name, c in states.items()} == {"gpu": "warn", "cuda_ipc": "warn", "gpudirect": "warn"}
    assert "cuda13" in states["gpu"].fix and "cuda12" not in states["gpu"].fix  # the driver's CUDA major picks it
    assert "--ipc=host" in states["cuda_ipc"].fix and "rdma port" not in states["gpudirect"].fix
    assert "no active RDMA port" in states["gpudirect"].finding
    assert exit_status(checks) == 0  # only --memory cuda runs need them: never a failure of the fabric's readiness


def test_bench_info_lists_the_gpus_or_says_there_are_none(tmp_path):
    from bench.experiments.gpus import describe

    lines = describe(_facts(tmp_path))
    assert lines[0] == "driver: CUDA 13.0 (libcuda.so.1)"
    assert any(line.startswith("cuda:0 NVIDIA H100 80GB HBM3, 80.0 GiB") for line in lines)
    assert "cuda_ipc between two processes: works" in lines
    lines = describe(_facts(tmp_path, gpus=0, ipc="not tried: no GPU", cupy_problem="device memory needs CuPy"))
    assert lines[0].startswith("none: there is no NVIDIA driver here") and any("would not" in line for line in lines)
