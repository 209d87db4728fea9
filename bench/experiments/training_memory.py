"""How much memory a training run needs, checked before any rank starts (``bench model`` and ``bench scale``): the
most servers asked for, the largest model, against the memory available now."""

from __future__ import annotations

from typing import Any

#: what a server (its worker and its parameter server) holds at its peak, in bytes of the model: the weights and the
#: gradients, every worker's gradients of a parameter server's share, and what the transports copy and keep in
#: flight beside them. Measured with fcn5 (replayed compute): 4.2x with zerocopy at 4 servers, 5.4x (4 servers) to
#: 7.1x (8 servers) with grpc_tcp, the baselines below aside
HELD_PER_SERVER = 7
#: what a rank holds beside the model's tensors: Python, numpy, its transport (a rank with replayed compute peaks at
#: 55 to 75 MB with a tiny model)
RANK_BASELINE_BYTES = 64 << 20
#: what a worker computing for real adds beside the model's own variables: TensorFlow (the Local line, one process
#: training fcn5, peaks at 458 MB)
TENSORFLOW_BYTES = 256 << 20


def run_bytes(param_bytes: int, servers: int, real_compute: bool) -> int:
    """About the memory a training run of ``servers`` servers holds at once (bytes), for a model of ``param_bytes``:
    :data:`HELD_PER_SERVER` times the model and two ranks' :data:`RANK_BASELINE_BYTES` per server; with real compute
    each worker also holds the model's own variables and TensorFlow."""
    server = HELD_PER_SERVER * param_bytes + 2 * RANK_BASELINE_BYTES
    if real_compute:
        server += param_bytes + TENSORFLOW_BYTES
    return servers * server


def memory_problem(models: list[str], server_counts: list[int], compute: str, launcher: Any) -> str | None:
    """Why the most servers asked for cannot train the largest model in the memory available now (``MemAvailable``),
    with the most servers that fit; None when they fit, when the ranks do not all run here (a job's launcher), or
    when neither the memory available nor a model's size is known (a model of the user's)."""
    from bench.experiments.models import MB, get_model
    from bench.ground.memory import available_memory_bytes

    if not launcher.starts_processes or not server_counts:
        return None
    sizes = {name: get_model(name).paper_model_mb for name in models if ":" not in name}
    sizes = {name: int(mb * MB) for name, mb in sizes.items() if mb}
    available = available_memory_bytes()
    if not sizes or available is None:
        return None
    model = max(sizes, key=sizes.__getitem__)
    servers, real = max(server_counts), compute == "real"
    needed = run_bytes(sizes[model], servers, real)
    if needed <= available:
        return None
    per_server = run_bytes(sizes[model], 1, real)
    fits = available // per_server
    fix = f"at most --servers {fits} fits" if fits else "not even 1 server fits: choose a smaller model"
    return (f"--servers {servers}: training {model} ({sizes[model] / 2**20:.0f} MB of parameters) on {servers} servers "
            f"holds about {needed / 2**30:.1f} GB at once (about {per_server / 2**30:.1f} GB a server: its two ranks "
            f"and {HELD_PER_SERVER}x the model in weights, gradients and the transports' copies), but "
            f"{available / 2**30:.1f} GB of memory is available now (MemAvailable); {fix} (or free memory)")
