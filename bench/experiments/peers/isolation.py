"""Keeping a program that listens on every interface off the network without ``ip``: a network namespace of its own
(:data:`ENTER_NAMESPACE`, run in the process that execs it), or, where no namespace can be made (a container), every
address it binds put on loopback by a small preloaded library (:func:`loopback_environment`), and a check of the
kernel's socket table that nothing of it listens elsewhere (:func:`listening_off_loopback`).

The ``mpi`` peer lines use them (``bench.experiments.peers.mpi``): Open MPI 5's PRRTE binds its listener to
INADDR_ANY whatever its MCA parameters say (``oob_tcp_if_include`` only chooses the addresses it tells others), so
no option of Open MPI's keeps it on loopback.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.experiments.peers import PeerLineError

#: ``enter_namespace()``: this process into a network namespace of its own (and a user namespace mapping its own ids
#: when not root), loopback up; raises OSError where the kernel refuses. Run in the program that execs mpirun
ENTER_NAMESPACE = """
def enter_namespace():
    import ctypes, fcntl, os, socket, struct
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    flags = 0x40000000 | (0 if os.geteuid() == 0 else 0x10000000)  # CLONE_NEWNET, CLONE_NEWUSER
    if libc.unshare(flags) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"unshare: {os.strerror(error)}")
    if flags & 0x10000000:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:  # SIOCGIFFLAGS, then SIOCSIFFLAGS with IFF_UP
        now = struct.unpack("16sH22x", fcntl.ioctl(sock, 0x8913, struct.pack("16sH22x", b"lo", 0)))[1]
        fcntl.ioctl(sock, 0x8914, struct.pack("16sH22x", b"lo", now | 1))
"""



@functools.cache
def own_namespace_problem() -> str | None:
    """Why no process can get a network namespace of its own here (the kernel's or a container's refusal, in one
    line), or None. Probed once, in a child."""
    probe = subprocess.run([sys.executable, "-I", "-c", ENTER_NAMESPACE + "enter_namespace()\n"],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if probe.returncode == 0:
        return None
    lines = probe.stderr.strip().splitlines()
    return lines[-1].removeprefix("PermissionError: ").removeprefix("OSError: ") if lines else (
        f"the probe exited with code {probe.returncode}")


#: a library preloaded into mpirun and its MPI processes where no network namespace can be made: every IPv4 and IPv6
#: address they bind (a listener's above all: PRRTE binds INADDR_ANY whatever it is told) is put on loopback, and a
#: socket that listens unbound is bound there first
_BIND_LOOPBACK_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);
typedef int (*listen_fn)(int, int);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    bind_fn real = (bind_fn) dlsym(RTLD_NEXT, "bind");
    if (addr != NULL && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in in4;
        memcpy(&in4, addr, sizeof in4);
        in4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        return real(fd, (const struct sockaddr *) &in4, sizeof in4);
    }
    if (addr != NULL && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 in6;
        memcpy(&in6, addr, sizeof in6);
        in6.sin6_addr = in6addr_loopback;
        return real(fd, (const struct sockaddr *) &in6, sizeof in6);
    }
    return real(fd, addr, len);
}

int listen(int fd, int backlog) {
    listen_fn real = (listen_fn) dlsym(RTLD_NEXT, "listen");
    struct sockaddr_storage here;
    socklen_t len = sizeof here;
    if (getsockname(fd, (struct sockaddr *) &here, &len) == 0) {
        if (here.ss_family == AF_INET && ((struct sockaddr_in *) &here)->sin_port == 0)
            bind(fd, (struct sockaddr *) &here, sizeof(struct sockaddr_in));
        else if (here.ss_family == AF_INET6 && ((struct sockaddr_in6 *) &here)->sin6_port == 0)
            bind(fd, (struct sockaddr *) &here, sizeof(struct sockaddr_in6));
    }
    return real(fd, backlog);
}
"""


def compiler() -> str:
    import sysconfig

    return (sysconfig.get_config_var("CC") or "cc").split()[0]


def compiler_problem() -> str | None:
    program = compiler()
    return None if shutil.which(program) else f"no C compiler ({program}) to build the library that does it"


def loopback_environment(private: str, env: dict[str, str]) -> dict[str, str]:
    """The environment that puts every address the pair binds on loopback: the library built into ``private`` and
    preloaded; PRRTE's listener on IPv4 only (it asks for both, and the host may have no IPv6 loopback)."""
    source, library = Path(private) / "bind-loopback.c", Path(private) / "bind-loopback.so"
    source.write_text(_BIND_LOOPBACK_C)
    built = subprocess.run([compiler(), "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if built.returncode != 0:
        tail = " ".join(built.stderr.strip().splitlines()[-2:])
        raise PeerLineError(f"the library that binds the pair's listeners to loopback did not build: {tail}")
    preload = " ".join(filter(None, [str(library), env.get("LD_PRELOAD", "")]))
    return {"LD_PRELOAD": preload, "PRTE_MCA_oob_tcp_disable_ipv6_family": "1"}


def process_tree(root: int) -> set[int]:
    """``root`` and every process descended from it."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[1])
    tree, grown = {root}, True
    while grown:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grown = bool(more)
    return tree


def listening_off_loopback(pids: set[int]) -> list[str]:
    """The TCP addresses off loopback that the processes ``pids`` listen on (``ADDRESS:PORT``), read from the
    kernel's tables of this network namespace."""
    inodes: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(int(link[8:-1]))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                if len(fields) < 10 or fields[3] != "0A" or int(fields[9]) not in inodes:  # 0A: LISTEN
                    continue
                hexed, port = fields[1].split(":")
                raw = b"".join(bytes.fromhex(hexed[i:i + 8])[::-1] for i in range(0, len(hexed), 8))
                address = ipaddress.ip_address(raw)
                mapped = getattr(address, "ipv4_mapped", None)
                if not (mapped or address).is_loopback:
                    found.append(f"{address}:{int(port, 16)}")
    return found
