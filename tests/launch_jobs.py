"""Jobs for the launcher tests, importable by name in the ranks' processes."""

from __future__ import annotations

import os
import signal
import time

#: seconds within which a living rank answers: generous, the machine running the tests may be busy
BOUND_S = 60


def hello(ctx):
    return {"rank": ctx.rank, "size": ctx.size, "name": ctx.name, "pid": os.getpid(),
            "address": ctx.cluster.addresses[ctx.rank]}


def ping_pong(ctx, rounds=20):
    """Ranks 0 and 1 pass a counter back and forth through the coordinator; each reports progress."""
    peer = 1 - ctx.rank
    if ctx.rank == 0:
        ctx.send_to(peer, 0)
    last = None
    for _ in range(rounds):
        last = ctx.receive(timeout=60)
        ctx.report(("progress", ctx.rank, last))
        ctx.send_to(peer, last + 1)
    return last


def late_message(ctx):
    """Rank 1 finishes at once; rank 0 sends it a message once it is surely gone, then finishes too."""
    if ctx.rank == 1:
        return "done"
    time.sleep(2.0)
    ctx.send_to(1, "too late")
    return "sent"


def fail(ctx, wait_for_go=False):
    if wait_for_go:
        ctx.receive()
    raise ValueError(f"rank {ctx.rank} was told to fail")


def die(ctx, wait_for_go=False):
    if wait_for_go:
        ctx.receive()
    os.kill(os.getpid(), signal.SIGKILL)


def crash(ctx, while_stderr_is_held=False):
    """Fault as a library would (SIGSEGV), in ``crash_here``; optionally while descriptor 2 is held back, as
    during TensorFlow's import."""
    import contextlib

    from bench.ground.quiet_tensorflow import start_up_noise_held_back

    with start_up_noise_held_back() if while_stderr_is_held else contextlib.nullcontext():
        crash_here()


def crash_here():
    import ctypes

    ctypes.string_at(0)  # reads address 0: SIGSEGV


def wait_forever(ctx, go_to=None):
    """Report this process's pid, tell rank ``go_to`` (if any) to go on, then wait to be ended."""
    ctx.report(("pid", os.getpid()))
    if go_to is not None:
        ctx.send_to(go_to, "go")
    while True:
        time.sleep(1)


def silent(ctx, seconds=600):
    time.sleep(seconds)


LINK_PAYLOAD = 1 << 20


def link_traffic(ctx):
    """Ranks 0 and 1 on two hosts: each sends the other LINK_PAYLOAD bytes over TCP; returns what its link counted."""
    import socket
    import threading

    host, port = ctx.cluster.addresses[ctx.rank].rsplit(":", 1)
    before = ctx.link_bytes()
    with socket.create_server((host, int(port))) as server:
        got = []

        def serve():
            conn, _ = server.accept()
            with conn:
                total = 0
                while chunk := conn.recv(1 << 16):
                    total += len(chunk)
                got.append(total)

        thread = threading.Thread(target=serve)
        thread.start()
        peer_host, peer_port = ctx.cluster.addresses[1 - ctx.rank].rsplit(":", 1)
        for _ in range(600):  # the peer may not listen yet
            try:
                with socket.create_connection((peer_host, int(peer_port)), timeout=10) as out:
                    out.sendall(b"x" * LINK_PAYLOAD)
                break
            except ConnectionRefusedError:
                time.sleep(0.1)
        thread.join()
    after = ctx.link_bytes()
    return {"address": ctx.cluster.addresses[ctx.rank], "received": after[1] - before[1], "got": got[0]}


def fail_after_telling(ctx):
    """Rank 1 tells rank 0 it is going, then fails of its own; rank 0 fails on hearing it (as on a vanished peer)."""
    from transports import PeerError

    if ctx.rank == 1:
        ctx.send_to(0, "going")
        time.sleep(0.5)
        raise ValueError("rank 1 broke of its own")
    ctx.receive()
    raise PeerError("rank 1 closed its connection")


def stop_self(ctx):
    """Report this process's pid, then stop it (SIGSTOP: its heartbeats stop too); nothing continues it."""
    ctx.report(("pid", os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)


def wait_for_anything(ctx):
    ctx.report(("pid", os.getpid()))
    return ctx.receive()


def word_before_mark(ctx, mark, confirm=True):
    """Rank 0 asks the coordinator to pause, tells rank 1 a word (``tell``, or plain ``send_to``), then leaves a
    mark on disk; rank 1 waits for the mark (never looking at its inbox meanwhile) and says what its inbox held."""
    if ctx.rank == 0:
        ctx.report("pause")  # the coordinator's on_report sleeps on it: the word waits behind it
        if confirm:
            ctx.tell([1], "word", timeout=60)
        else:
            ctx.send_to(1, "word")
        open(mark, "w").close()
        return "told"
    while not os.path.exists(mark):
        time.sleep(0.01)
    return ctx.poll()


def knock(ctx, token):
    """Knock on the run's hub as a stranger would: a connection of its own with ``token`` (not the run's). The hub
    is where this rank's own line to the coordinator leads (a Unix socket's path, or a TCP address). Returns
    where it knocked and how it was answered."""
    import socket

    from bench.launch.context import connect
    from bench.launch.messages import LaunchError

    with socket.socket(fileno=os.dup(ctx._conn.fileno())) as line:
        hub = line.getpeername()
    try:
        connect(hub, token).close()
    except LaunchError as exc:
        return {"hub": hub, "answer": str(exc)}
    return {"hub": hub, "answer": "admitted"}
