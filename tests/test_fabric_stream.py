"""The fabric's TCP stream (``transports/fabric/stream.py``): every access checked at the target, and no listener of
UCX's own tcp transport on any fabric transport (its target writes any address a peer names)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading

import numpy as np
import pytest

from transports.fabric.base import FabricError, RemoteRegion
from transports.fabric.stream import _ADDRESS_PREFIX, _REQUEST, KEY_BYTES, Grants, StreamChannel, StreamListener


@pytest.fixture
def target():
    """A listener granting one 64-byte region; beside it, 64 bytes it never granted."""
    grants = Grants()
    memory = np.zeros(128, np.uint8)
    granted, beside = memory[:64], memory[64:]
    key = grants.grant(granted)
    notified = []
    listener = StreamListener("127.0.0.1", grants, lambda: notified.append(1))  # a wake per write and doorbell
    channel = StreamChannel(listener.address, stopped=lambda: False, wait_counter=lambda counter, above, timeout: True)
    yield listener, channel, RemoteRegion(granted.ctypes.data, 64, key), granted, beside, notified
    channel.close()
    listener.close()


def test_writes_and_reads_inside_the_grant_land_and_a_notify_is_heard(target):
    listener, channel, region, granted, _, notified = target
    channel.write_flagged(np.arange(32, dtype=np.uint8), region.at(0, 32), np.full(1, 7, np.uint8), region.at(63, 1))
    assert granted[:32].tolist() == list(range(32)) and granted[63] == 7
    back = np.zeros(16, np.uint8)
    channel.read_now(back, region.at(8, 16))
    assert back.tolist() == list(range(8, 24))
    channel.wait(channel.notify(), 5)
    channel.wait(channel.flush(), 5)
    assert len(notified) == 2 and listener.refused == 0  # a wake for the write (data and trailer came as one), one bell


@pytest.mark.parametrize("where", ["past the end", "before the start", "beside, with the key"])
def test_an_access_outside_the_grant_is_refused_touches_nothing_and_the_stream_goes_on(target, where):
    listener, channel, region, granted, beside, _ = target
    outside = {"past the end": RemoteRegion(region.addr + 32, 64, region.rkey),
               "before the start": RemoteRegion(region.addr - 8, 16, region.rkey),
               "beside, with the key": RemoteRegion(beside.ctypes.data, 64, region.rkey)}[where]
    with pytest.raises(FabricError, match=r"refused a write of .* lies outside the region its remote key grants"):
        channel.write_flagged(np.full(outside.length, 0x5A, np.uint8), outside)
    with pytest.raises(FabricError, match=r"refused a read of .* lies outside"):
        channel.read_now(np.zeros(outside.length, np.uint8), outside)
    assert not granted.any() and not beside.any()
    assert listener.refused == 2
    channel.write_flagged(np.ones(8, np.uint8), region.at(0, 8))  # the connection is still in step
    assert granted[:8].tolist() == [1] * 8 and channel.failed() is None


def test_a_key_never_granted_reaches_nothing_even_at_a_granted_address(target):
    _, channel, region, granted, _, _ = target
    forged = RemoteRegion(region.addr, 64, os.urandom(KEY_BYTES))
    with pytest.raises(FabricError, match="never granted"):
        channel.write_flagged(np.full(64, 0x5A, np.uint8), forged)
    assert not granted.any()


def test_a_revoked_key_reaches_nothing(target):
    listener, channel, region, granted, _, _ = target
    listener.grants.revoke(region.rkey)
    with pytest.raises(FabricError, match="never granted"):
        channel.write_flagged(np.full(8, 1, np.uint8), region.at(0, 8))
    assert not granted.any()


def test_a_raw_client_speaking_garbage_is_cut_off_and_writes_nothing(target):
    listener, _, _, granted, beside, _ = target
    host, port = listener.address.split(b":", 1)[1].decode().rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(_REQUEST.pack(99, bytes(KEY_BYTES), beside.ctypes.data, 64) + b"\x5a" * 64)
        raw.settimeout(10)
        try:
            heard = raw.recv(1)
        except ConnectionResetError:  # it hung up with the payload unread
            heard = b""
        assert heard == b""  # the target hung up on an operation it does not know
    assert not granted.any() and not beside.any()


@pytest.mark.parametrize("fabric_transport", ["auto", "shm", "tcp"])
def test_no_fabric_transport_opens_a_listener_of_ucx_s_tcp(fabric_transport):
    """UCX's tcp transport would listen on a port (ucx's tcp iface); the fabric never opens it. Over tcp the one
    listener is the fabric's own stream, on loopback by default."""
    from transports.fabric.ucx.device import UcxDevice

    before = _listening()
    device = UcxDevice(fabric_transport)
    try:
        opened = _listening() - before
        if fabric_transport == "tcp":
            assert [local for local, _ in opened] == [("127.0.0.1", int(device.address[0].rsplit(b":", 1)[1]))]
        else:
            assert opened == set()
        assert "tcp" not in device.tls.lstrip("^").split(",") or device.tls.startswith("^")
    finally:
        device.close()


def _listening() -> set[tuple[tuple[str, int], int]]:
    """The TCP sockets this process listens on: ((address, port), inode)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as listed:
                lines = listed.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A" or int(fields[9]) not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            host = socket.inet_ntoa(bytes.fromhex(address)[::-1]) if len(address) == 8 else address
            found.add(((host, int(port, 16)), int(fields[9])))
    return found


def test_with_the_run_s_token_required_a_connection_that_cannot_prove_it_reaches_nothing():
    """Once the run's token is set, a connector answers the listener's nonce under it before any request is read: a
    connector with another token (or none) is cut off, its writes land nowhere, even with a key that was granted."""
    grants = Grants()
    memory = np.zeros(64, np.uint8)
    key = grants.grant(memory)
    listener = StreamListener("127.0.0.1", grants, lambda: None)
    listener.require_token("the-run-s-token")
    region = RemoteRegion(memory.ctypes.data, 64, key)
    try:
        for token in ("another-token", None):
            try:
                stranger = StreamChannel(listener.address, stopped=lambda: False,
                                         wait_counter=lambda counter, above, timeout: True, token=token)
            except FabricError:
                continue  # refused at the handshake
            with pytest.raises(FabricError):
                stranger.write_flagged(np.full(64, 0x5A, np.uint8), region, timeout=10)
            # the stranger may learn of its failure (the nonce read as no answer) before the listener has counted
            # it: the listener ends the connection once it has
            stranger._socket.settimeout(30)
            with contextlib.suppress(ConnectionResetError):  # (closed with the stranger's request unread)
                while stranger._socket.recv(1 << 16):
                    pass
            stranger.close()
        assert not memory.any() and listener.unproven == 2
        member = StreamChannel(listener.address, stopped=lambda: False,
                               wait_counter=lambda counter, above, timeout: True, token="the-run-s-token")
        member.write_flagged(np.ones(64, np.uint8), region, timeout=10)
        member.close()
        assert memory.tolist() == [1] * 64
    finally:
        listener.close()


def test_bytes_that_are_no_answer_fail_the_write_that_waits_for_one():
    """A listener that asks for the run's token sends its nonce first; a connector that proved none read the nonce's
    first byte as the status of its write, and took a 0 (1 time in 256) for done. Any answer but "done" (status 0,
    no reason) or a refusal with its reason fails the write and the channel."""
    server = socket.create_server(("127.0.0.1", 0))
    host, port = server.getsockname()

    def listener():
        connection, _ = server.accept()
        connection.sendall(b"\x00\x07" + bytes(14))  # a nonce whose first byte is 0
        connection.recv(1 << 16)
        connection.close()

    thread = threading.Thread(target=listener, daemon=True)
    thread.start()
    channel = StreamChannel(_ADDRESS_PREFIX + f"{host}:{port}".encode(), stopped=lambda: False,
                            wait_counter=lambda counter, above, timeout: True)
    try:
        with pytest.raises(FabricError, match="no answer"):
            channel.write_flagged(np.ones(8, np.uint8), RemoteRegion(4096, 8, bytes(16)), timeout=10)
        with pytest.raises(FabricError, match="failed connection"):
            channel.write_flagged(np.ones(8, np.uint8), RemoteRegion(4096, 8, bytes(16)), timeout=10)
    finally:
        channel.close()
        server.close()
        thread.join(5)
