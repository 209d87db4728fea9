"""The ``ucx`` fabric's library: loading UCX's binding (cffi), and what this UCX offers and how the fabric sets it up:
the UCX transports behind each ``--fabric-transport`` (never sysv nor UCX's tcp, see below), UCX settings from the
RDMA_* variables, where UCX is installed (for its benchmark programs), and what ``ucx_info`` lists.

:func:`load` hands the loaded library to the modules that call into it (``channel.py``, ``progress.py``);
``device.py`` opens devices with it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transports.fabric.base import FabricError
from transports.fabric.netdev import interface_addresses
from transports.fabric.settings import RdmaSettings
from transports.fabric.ucx.channel import bind as bind_channels
from transports.fabric.ucx.progress import bind as bind_progress

#: points the binding at a system UCX instead of the libucx-cu12 wheel (read by build.py too)
UCX_HOME_VARIABLE = "TENSOR_BENCH_UCX_HOME"
#: UCX transports (UCX_TLS) behind each --fabric-transport choice
#: "rdma": UCX's RC transports (rc_verbs, rc_mlx5, with UD to set them up) and nothing else; "tcp": UCX only
#: allocates and registers memory ("self" reaches no peer), the fabric's own stream carries the data
FABRIC_TRANSPORTS = {"auto": "", "shm": "shm", "tcp": "self", "rdma": "rc"}
#: the UCX transport never used for data: its target copies a put to whatever address the request names, with an
#: empty remote key (uct_tcp_ep_handle_put_req in UCX's src/uct/tcp/tcp_ep.c; UCX_TCP_PUT_ENABLE=n only stops
#: this side offering put), so any process that reaches its listener could write anywhere in the process. Over
#: TCP the fabric's own stream carries the data and checks every access (transports/fabric/stream.py)
UNCHECKED_TRANSPORT = "tcp"
#: UCX_TLS of UCX's own benchmark programs (the reference lines) behind each --fabric-transport choice: over tcp
#: they measure UCX's tcp transport, a program of its own that lives for the reference run
TOOL_TRANSPORTS = {**FABRIC_TRANSPORTS, "tcp": "tcp"}
#: the UCX transport never used: its SysV segments are created mode 0660 (UCT_MM_SYSV_PERM in UCX's
#: uct/sm/mm/sysv/mm_sysv.c, fixed at build time, no setting changes it, a umask does not apply to SysV IPC),
#: so any process of the owner's group could shmat the worker's FIFO and every region UCP allocated (the pool's
#: tensors: UCX_ALLOC_PRIO puts md:sysv first). Without it, UCX's posix transport carries shared memory and
#: allocates the regions: files made mode 0600, unlinked at once and reached by a peer through
#: /proc/<pid>/fd/<fd>, which only a process allowed to ptrace the owner may open (the same user); cma, for
#: registered user memory, needs that same permission. A put over posix is the same memcpy into a shared mapping.
GROUP_SHARED_TRANSPORT = "sysv"
#: the UCX_TLS aliases that take in sysv, with their transports (ucp_tl_aliases in UCX's ucp/core/ucp_context.c)
_SHARED_MEMORY_ALIASES = {
    "mm": ("posix", "sysv", "xpmem"),
    "sm": ("posix", "sysv", "xpmem", "knem", "cma"),
    "shm": ("posix", "sysv", "xpmem", "knem", "cma"),
}
#: UCX's CUDA transports, added to a UCX_TLS the fabric chose where this UCX offers them (a GPU here): cuda_copy (UCX
#: finds a buffer's memory type and copies between host and device) and cuda_ipc (a put or get between the GPU memory
#: of two processes of one node, through the peer's mapped IPC handle)
DEVICE_TRANSPORTS = ("cuda_copy", "cuda_ipc")
#: the lock UCX takes around a worker's progress (thread mode MULTI: a progress thread and every waiting thread
#: progress the same worker): a mutex, not UCX's default spinlock (USE_MT_MUTEX=n). On a loaded core a thread
#: preempted while it holds the spinlock leaves the others spinning out their whole time slices; over UCX's tcp,
#: where every transfer needs the target's progress, 15% of 1KB transfers took over 1 ms (p90 2.9 ms), 0.8%
#: with the mutex (p90 176 µs). A user's own UCX_USE_MT_MUTEX wins.
WORKER_LOCK = {"USE_MT_MUTEX": "y"}

_ffi = _lib = None
_load_error: str | None = None


def load() -> tuple[Any, Any]:
    """The cffi module, loading the UCX libraries first; raises FabricError saying why it cannot.

    With ``$TENSOR_BENCH_UCX_HOME`` set, the binding built against that UCX (``_ucp_system``, built by
    ``pip install`` when the variable was set then); otherwise the libucx-cu12 wheel's (``_ucp``).
    """
    global _ffi, _lib, _load_error
    if _lib is not None:
        return _ffi, _lib
    if _load_error is not None:
        raise FabricError(_load_error)
    home = os.environ.get(UCX_HOME_VARIABLE)
    try:
        if home:
            from transports.fabric.ucx._ucp_system import ffi, lib
        else:
            import libucx

            libucx.load_library()
            from transports.fabric.ucx._ucp import ffi, lib
    except ImportError as exc:
        if home:
            _load_error = (f"{UCX_HOME_VARIABLE}={home}, but the binding for a system UCX is not built ({exc}); "
                           f"reinstall with '{UCX_HOME_VARIABLE}={home} pip install -e .' so setup.py builds it "
                           f"(it needs that UCX's headers: on Debian, apt install libucx-dev)")
        else:
            _load_error = (f"the UCX binding is not built ({exc}); reinstall with 'pip install -e .' so setup.py "
                           f"builds it (it needs the libucx-cu12 wheel)")
        raise FabricError(_load_error) from None
    if not hasattr(lib, "tt_cuda_enter"):  # built by an older checkout: the shim has changed since
        _load_error = (f"the UCX binding ({'system' if home else 'libucx-cu12'}) was built from an older shim "
                       f"(transports/fabric/ucx/build.py); reinstall with "
                       f"'{f'{UCX_HOME_VARIABLE}={home} ' if home else ''}pip install -e .' to rebuild it")
        raise FabricError(_load_error)
    built = ffi.string(lib.tt_built_against()).decode()
    if home and os.path.realpath(built) != os.path.realpath(home):
        _load_error = (f"{UCX_HOME_VARIABLE}={home}, but the system binding was built against {built}; reinstall "
                       f"with '{UCX_HOME_VARIABLE}={home} pip install -e .', or set {UCX_HOME_VARIABLE}={built}")
        raise FabricError(_load_error)
    _ffi, _lib = ffi, lib
    bind_channels(ffi, lib)
    bind_progress(ffi, lib)
    return ffi, lib


def built_against() -> str:
    """Where the UCX in use comes from: ``libucx-cu12`` (the wheel) or the system install's directory."""
    load()
    return _ffi.string(_lib.tt_built_against()).decode()


def accepts_setting(name: str, value: str) -> bool:
    """Whether this UCX build knows the setting ``UCX_<name>`` and takes ``value`` for it."""
    load()
    return _lib.tt_config_accepts(name.encode(), str(value).encode()) == _lib.UCS_OK


_offered: dict[str, bool] = {}
#: the UCT component of each transport asked about whose name is not the transport's own
_COMPONENTS = {"cuda_copy": "cuda_cpy"}


def offers_transport(name: str) -> bool:
    """Whether this UCX offers the transport ``name`` here: a shared-memory one (posix, xpmem, knem, cma) or a CUDA
    one (cuda_copy, cuda_ipc: a GPU is here and this UCX was built with CUDA); cached."""
    load()
    if name not in _offered:
        _offered[name] = bool(_lib.tt_offers_tl(_COMPONENTS.get(name, name).encode(), name.encode()))
    return _offered[name]


def with_device_transports(tls: str, offers=offers_transport) -> str:
    """``tls`` (a list the fabric chose, as :func:`owner_only_tls` gives it) with UCX's CUDA transports this UCX
    offers here (:data:`DEVICE_TRANSPORTS`): put from and into GPU memory, within a node through CUDA IPC. An
    exclusion list (``^sysv,tcp``) takes them in already."""
    if tls.startswith("^"):
        return tls
    names = tls.split(",")
    return ",".join([*names, *(name for name in DEVICE_TRANSPORTS if name not in names and offers(name))])


def moves_device_memory(tls: str, offers=offers_transport) -> bool:
    """Whether UCX under UCX_TLS ``tls`` moves GPU memory: it offers ``cuda_copy`` here (a GPU, a UCX built with
    CUDA) and ``tls`` takes it in."""
    names = [name.strip() for name in tls.lstrip("^").split(",")]
    taken = not any(name in ("cuda", "cuda_copy") for name in names) if tls.startswith("^") else (
        "cuda_copy" in names or "cuda" in names)
    return taken and offers("cuda_copy")


def owner_only_tls(requested: str, offers=offers_transport) -> str:
    """The UCX_TLS that gives ``requested`` (a UCX_TLS value; "" or "all": every transport) without sysv and tcp.

    See :data:`GROUP_SHARED_TRANSPORT` and :data:`UNCHECKED_TRANSPORT` for why. An exclusion list (``^a,b``) gains
    both; an alias that takes sysv in (``shm``, ``sm``, ``mm``) is spelt out as its other transports that this UCX
    offers (``offers(name)``; naming one it lacks would make UCX warn); a list that asks for nothing else is an
    error that says what to use instead.
    """
    never = (GROUP_SHARED_TRANSPORT, UNCHECKED_TRANSPORT)
    text = requested.strip()
    if text in ("", "all"):
        return "^" + ",".join(never)
    names = [name.strip() for name in text.lstrip("^").split(",") if name.strip()]
    if text.startswith("^"):
        shared_out = GROUP_SHARED_TRANSPORT in names or any(name in _SHARED_MEMORY_ALIASES for name in names)
        added = [name for name in never if name not in names and not (name == GROUP_SHARED_TRANSPORT and shared_out)]
        return "^" + ",".join([*names, *added])
    chosen: list[str] = []
    for name in names:
        if name in _SHARED_MEMORY_ALIASES:
            members = [m for m in _SHARED_MEMORY_ALIASES[name] if m != GROUP_SHARED_TRANSPORT and offers(m)]
        else:
            members = [] if name in never else [name]
        chosen += [member for member in members if member not in chosen]
    if not chosen:
        raise FabricError(f"ucx: UCX_TLS={requested} leaves no transport: the fabric never uses UCX's "
                          f"{GROUP_SHARED_TRANSPORT} (its segments are open to the owner's whole group) nor its "
                          f"{UNCHECKED_TRANSPORT} (its target writes any address a peer names). Shared memory: posix "
                          f"(UCX_TLS=posix,cma); TCP: --fabric-transport tcp, the fabric's own checked stream")
    return ",".join(chosen)


def ucx_settings(settings: RdmaSettings, accepts=accepts_setting) -> tuple[dict[str, str], dict[str, str]]:
    """The UCX settings (name without ``UCX_`` -> value) that mean what the RDMA_* ``settings`` ask for, and
    the variables that have no such setting in this UCX build (``accepts(name, value)`` says), with why."""
    wanted: dict[str, tuple[str, str, str]] = {}  # UCX name -> (value, variable, what it means)
    if settings.device:
        device = f"{settings.device}:{settings.port}" if settings.port else settings.device
        wanted["NET_DEVICES"] = (device, "RDMA_DEVICE", "device (and port)")
    if settings.gid_index is not None:
        wanted["IB_GID_INDEX"] = (str(settings.gid_index), "RDMA_GID_INDEX", "GID index")
    if settings.timeout is not None:  # verbs' timeout is an exponent: 4.096 us * 2^timeout
        wanted["RC_TIMEOUT"] = (f"{4.096 * 2**settings.timeout:.3f}us", "RDMA_QP_TIMEOUT", "retransmission timeout")
    if settings.retry_count is not None:
        wanted["RC_RETRY_COUNT"] = (str(settings.retry_count), "RDMA_QP_RETRY_COUNT", "retry count")
    if settings.service_level is not None:
        wanted["IB_SL"] = (str(settings.service_level), "RDMA_QP_SL", "service level")
    if settings.traffic_class is not None:
        wanted["IB_TRAFFIC_CLASS"] = (str(settings.traffic_class), "RDMA_TRAFFIC_CLASS", "traffic class")
    if settings.mtu is not None:
        wanted["IB_PATH_MTU"] = (str(settings.mtu), "RDMA_QP_MTU", "path MTU")
    no_effect: dict[str, str] = {}
    if settings.pkey_index is not None:
        no_effect["RDMA_QP_PKEY_INDEX"] = "UCX selects partition keys by value, not by index"
    if settings.port is not None and not settings.device:
        no_effect["RDMA_DEVICE_PORT"] = "it applies only together with RDMA_DEVICE"
    config = {}
    for name, (value, variable, meaning) in wanted.items():
        if accepts(name, value):
            config[name] = value
        else:
            no_effect[variable] = f"this UCX has no setting UCX_{name} ({meaning}; it needs InfiniBand transports)"
    return config, no_effect


def no_rdma_reason(detail: str) -> str:
    """Why UCX reaches no RDMA device: ``detail`` (UCX's words), what this UCX is and the fixes."""
    origin = built_against()
    which = "the libucx-cu12 wheel (shared memory and tcp only)" if origin == "libucx-cu12" else f"the UCX in {origin}"
    return (f"{which} has no RC transport on an active RDMA port ({detail}); use --fabric verbs, or reinstall "
            f"against a UCX with verbs ({UCX_HOME_VARIABLE}=/usr pip install -e . with Debian's libucx-dev)")


def ucx_home() -> Path:
    """The UCX install the fabric uses: ``$TENSOR_BENCH_UCX_HOME``, else the libucx-cu12 wheel."""
    if os.environ.get(UCX_HOME_VARIABLE):
        return Path(os.environ[UCX_HOME_VARIABLE])
    try:
        import libucx  # the PyPI wheel libucx-cu12
    except ImportError:
        raise FabricError(
            "ucx: the libucx-cu12 wheel is not installed; install it with 'pip install -e .' "
            f"(or set {UCX_HOME_VARIABLE} to a UCX install)"
        ) from None
    return Path(libucx.__file__).parent


def listen_host(interfaces: list[str] | tuple[str, ...]) -> str:
    """Where the fabric's TCP stream listens: the IPv4 address of the first of the cluster's interfaces that has
    one, else loopback."""
    addresses = interface_addresses() if interfaces else {}
    return next((addresses[name] for name in interfaces if name in addresses), "127.0.0.1")


def parse_ucx_info(text: str) -> dict[str, list[str]]:
    """UCX transport -> its devices, in the order ``ucx_info -d`` lists them (``{"tcp": ["eth0", "lo"],
    "rc_verbs": ["rxe0:1"], ...}``)."""
    offered: dict[str, list[str]] = {}
    transport = None
    for line in text.splitlines():
        words = line.strip("# ").split(":", 1)
        if len(words) == 2 and words[0].strip() == "Transport":
            transport = words[1].strip()
        elif len(words) == 2 and words[0].strip() == "Device" and transport:
            offered.setdefault(transport, []).append(words[1].strip())
    return offered
