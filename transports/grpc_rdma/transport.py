"""TensorFlow's gRPC+verbs transport (the paper's gRPC.RDMA), on the fabric.

gRPC (the control path) only sets up: it exchanges fabric endpoints and the
descriptors of each side's message buffer and immediate ring. Protocol messages
and tensors then go over the fabric, following the design note in
``shared/seeds/tensorflow-grpc-verbs-design.txt``:

* Receive initiates: ``recv`` sends TENSOR_REQUEST with the receiver's cached
  meta-data and where to write. The sender, once the tensor is there (tag
  matching in a local rendezvous table), compares: when the meta-data is new or
  changed it keeps a clone of the tensor and answers META_DATA_RESPONSE; the
  receiver reallocates and sends TENSOR_RE_REQUEST; then the content is written.
  Failures on the sender come back as ERROR_STATUS.
* Per peer and direction one message is in flight: the writer marks the remote
  buffer busy; the reader parses the message and answers with an ACK, which
  marks it idle again. Further messages wait in a queue.
* ``buffered`` mode (the default, the paper's gRPC.RDMA): the sender copies the
  tensor into a registered send buffer, writes it into the receiver's registered
  proxy buffer, and the receiver copies it into the result tensor: one copy on
  each side. ``direct`` mode (the note's zero-copy): the receiver's result tensor
  is registered memory and the sender writes from the tensor itself. A tensor
  planned on a GPU at both ends, where the fabric moves device memory: its result
  is allocated on its device (the note's GPU direct), the sender's clone too;
  elsewhere device memory is staged through the host (the note's proxy tensor).
* Memory: buffered, a side holds the tensor and one staging buffer from the pool,
  freed after each transfer and reused by the next (the pool gives back segments
  it no longer needs before growing, so varying sizes do not add up); nothing
  keeps a result alive once the caller drops it.

*Immediate values.* Verbs delivers a 32-bit immediate with a write into the
receiver's completion queue: on the ``verbs`` fabric the transport uses that
(``Channel.write_with_imm``, collected with ``Device.take_immediates``). UCX has
no write-with-immediate: on the ``ucx`` fabric we emulate the completion queue
with an *immediate ring* per peer in the receiver's registered memory: after a
write (and a flush, so the data is complete) the writer puts a 9-byte entry into
the next slot, the immediate value and then a lap byte, which
the receiver polls like a flag. The values are those of the note: 0xFFFFFFFF for
a protocol message in the message buffer, 0xFFFFFFFE for an ACK (no data), and
the request index for tensor content. Entries per peer are bounded by one
message, one ACK and the receiver's outstanding requests, which ``recv`` caps
below the ring size (RDMA_QP_QUEUE_DEPTH), so a slot is never overwritten before
it is read.

Why one module of 800 lines: the sender's and the receiver's sides of one protocol, each reading the
other's messages (the wire format is ``protocol.py``, the rendezvous ``transports/rendezvous.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import zlib
from collections import Counter, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transports.base import Key, PeerError, TransportClosed, TransportError, TransportTimeout, memory_bytes
from transports.common import aligned_empty, in_device_memory, settle
from transports.fabric.base import Channel, FabricError, RemoteRegion
from transports.fabric.pool import Block
from transports.fabric_transport import LIVENESS_EVERY_S, MAX_BACKOFF_S, DeviceBlock, FabricTransport
from transports.grpc_rdma.protocol import (
    MESSAGE,
    LinkRequest,
    Message,
    MessageType,
    ProtocolError,
    TensorMeta,
    encode,
    parse,
    parse_link,
)
from transports.memory import Memory, memory_of
from transports.ports import release_port
from transports.rendezvous import Rendezvous
from transports.tensors import contiguous, read_by_now, ready, to_host

IMM_MESSAGE = 0xFFFFFFFF
IMM_ACK = 0xFFFFFFFE
RING_ENTRY = 16  # imm (u32), padding, lap byte at offset 8
MODES = ("buffered", "direct")
#: direct mode's device blocks kept for the next request of their peer and size, at most
MAX_SPARE_BLOCKS = 64


def lap(count: int, slots: int) -> int:
    """The lap byte of the ``count``-th ring entry: never 0 (an empty slot)."""
    return 1 + (count // slots) % 255


@dataclass(eq=False)
class _Link:
    """Everything about one peer: message buffers, immediate rings, pending requests."""

    peer: int
    rx_message: Block  # the peer writes its messages here
    tx_message: Block  # we build our messages here
    ring: Block  # the peer writes immediates here
    tx_entry: Block  # we build our ring entries here
    slots: int
    channel: Channel | None = None
    peer_message: RemoteRegion | None = None
    peer_ring: RemoteRegion | None = None
    written: int = 0  # entries we wrote into the peer's ring
    read: int = 0  # entries we consumed from our ring
    remote_busy: bool = False  # our message in the peer's buffer is not ACKed yet
    attached: LinkRequest | None = None  # what the peer told us at setup (a second, different one is refused)
    responses: dict[int, _Response] = field(default_factory=dict)  # clones waiting for their re-request
    queue: deque[Message] = field(default_factory=deque)
    ready: threading.Event = field(default_factory=threading.Event)
    lock: threading.RLock = field(default_factory=threading.RLock)


@dataclass(eq=False)
class _Request:
    """Receiver side of one tensor request (RdmaTensorRequest)."""

    index: int
    key: Key
    future: Future
    meta: TensorMeta | None
    buffer: Block | DeviceBlock | None = None  # proxy (buffered) or result (direct) tensor in registered memory
    #: direct mode, a tensor planned on a device at both ends: the result's device memory (None: host memory)
    memory: Memory | None = None
    checksum: int | None = None
    re_requested: bool = False  # a second META_DATA_RESPONSE would move the buffer under the sender's write


@dataclass(eq=False)
class _Response:
    """Sender side of a request waiting for its re-request (RdmaTensorResponse): the clone."""

    index: int
    key: Key
    clone: Block | DeviceBlock
    meta: TensorMeta


class GrpcRdmaTransport(FabricTransport):
    """gRPC for setup, RDMA message buffers for the protocol; see the module docstring."""

    name = "grpc_rdma"
    completes_on_threads = True  # the poller thread serves the receiver's requests

    def __init__(self, *, mode: str = "buffered", validate: bool = False, **options: Any) -> None:
        super().__init__(**options)
        if mode not in MODES:
            raise ValueError(f"grpc_rdma: unknown mode '{mode}' (known: {', '.join(MODES)})")
        self.mode = mode
        #: direct mode writes a tensor planned on a device at both ends from the sender's device into a result on
        #: the receiver's (the seed design's result tensor "allocated on its appropriate device", GPU direct);
        #: buffered mode's proxy buffer is host memory, as the design's proxy tensor is
        self.writes_device_memory = mode == "direct"
        self.validate = validate
        #: direct mode's device blocks given back, one per (peer, size, memory), for that peer's next request
        self._spare_blocks: dict[tuple[int | None, int, Memory], DeviceBlock] = {}
        self._links: dict[int, _Link] = {}
        self._requests: dict[tuple[int, int], _Request] = {}  # (peer, index)
        #: requests whose recv gave up (timed out or was cancelled): their buffer and slot are kept
        #: until the sender confirms the CANCEL, since until then it may still write into them
        self._abandoned: dict[tuple[int, int], _Request] = {}
        #: sender side: requests waiting for their tensor, by (peer, index), so that a CANCEL finds them
        self._serving: dict[tuple[int, int], tuple[Key, Future]] = {}
        self._meta_cache: dict[tuple[str, int], TensorMeta] = {}
        self._lent: dict[tuple[str, int], Block | DeviceBlock] = {}  # direct mode: results handed out
        self._indices = itertools.count(1)
        self._outstanding: dict[int, threading.Semaphore] = {}
        #: native immediates from a peer whose link is not ready yet: (its device address, value)
        self._early_immediates: list[tuple[tuple[bytes, ...], int]] = []
        #: protocol messages written, by type, and how many had to wait behind a busy buffer
        self.messages_sent: Counter[str] = Counter()
        self.messages_queued = 0

    @classmethod
    def variants(cls) -> dict[str, dict[str, Any]]:
        fabrics = super().variants()
        return {f"{mode}-{label}": {"mode": mode, **options} for mode in MODES for label, options in fabrics.items()}

    @classmethod
    def modes(cls) -> dict[str, dict[str, Any]]:
        """Named option sets a user can pick as ``grpc_rdma:<mode>``."""
        return {mode: {"mode": mode} for mode in MODES}

    def control_handlers(self) -> dict[str, Any]:
        return {"link": self._on_link}

    def describe(self) -> dict[str, Any]:
        described = super().describe()
        described.update(mode=self.mode, validate=self.validate, queue_depth=self.settings.queue_depth,
                         immediates="native" if self.device is not None and self.device.immediates else "ring")
        return described

    def start(self, cluster, rank) -> None:
        super().start(cluster, rank)
        self._outbox = Rendezvous(f"grpc_rdma rank {rank}")
        self._poller = threading.Thread(target=self._poll, name=f"grpc_rdma-poller-{rank}", daemon=True)
        self._poller.start()

    def _before_device_close(self) -> None:
        closed = TransportClosed(f"grpc_rdma rank {self.rank} was closed")
        for _array, sent in self._outbox.close():
            settle(sent, error=closed)
        with self._lock:
            requests, self._requests = list(self._requests.values()), {}
            self._abandoned = {}
        for request in requests:
            settle(request.future, error=closed)
        self._poller.join(timeout=5)

    # links: setup over gRPC ------------------------------------------------

    def _link(self, peer: int) -> _Link:
        with self._lock:
            if peer not in self._links:
                slots = self.settings.queue_depth
                self._links[peer] = _Link(
                    peer,
                    # what the peer writes, in segments of its alone: its key reaches no other peer's memory
                    rx_message=self.pool.alloc(MESSAGE.itemsize, peer=peer),
                    tx_message=self.pool.alloc(MESSAGE.itemsize),
                    ring=self.pool.alloc(slots * RING_ENTRY, peer=peer),
                    tx_entry=self.pool.alloc(RING_ENTRY),
                    slots=slots,
                )
                self._links[peer].ring.array[:] = 0
                # the ring holds a message, an ACK and the requests in flight
                self._outstanding[peer] = threading.Semaphore(slots - 4)
            return self._links[peer]

    def _describe_link(self, link: _Link) -> dict[str, Any]:
        return {
            "device": [a.hex() for a in self.device.address],
            "message": link.rx_message.remote().to_json(),
            "ring": link.ring.remote().to_json(),
            "slots": link.slots,
        }

    def _parse_link(self, request: Any, want_rank: bool) -> LinkRequest:
        return parse_link(request, cluster_size=self.cluster.size, own_rank=self.rank,
                          slots=self.settings.queue_depth, ring_entry=RING_ENTRY, want_rank=want_rank)

    def _attach(self, link: _Link, peer: LinkRequest) -> None:
        """Connect ``link`` to what the peer described; once: a different second description is refused."""
        with link.lock:
            if link.ready.is_set():
                if (peer.device, peer.message, peer.ring) != (link.attached.device, link.attached.message,
                                                               link.attached.ring):
                    raise TransportError(f"grpc_rdma: rank {link.peer} is already linked; a rank links once")
                return
            link.channel = self._channel(link.peer, 0, list(peer.device))
            link.peer_message = peer.message
            link.peer_ring = peer.ring
            link.attached = peer
            link.ready.set()

    def _on_link(self, request: dict[str, Any]) -> dict[str, Any]:
        # validate everything before allocating anything: a caller may not make us allocate for ranks
        # that do not exist, nor twice for one that does
        try:
            peer = self._parse_link(request, want_rank=True)
        except ProtocolError as exc:
            raise TransportError(f"grpc_rdma rank {self.rank}: malformed link request: {exc}") from None
        with self._lock:
            fresh = peer.rank not in self._links
        link = self._link(peer.rank)
        try:
            self._attach(link, peer)
        except FabricError as exc:
            if fresh:
                self._unlink(link)
            # the control server prefixes its own name (this rank)
            raise TransportError(f"cannot reach the device of rank {peer.rank}: {exc}") from None
        except BaseException:
            if fresh:
                self._unlink(link)
            raise
        self._peer_devices.setdefault(peer.rank, list(peer.device))
        # its control server is up (it listens before it links): a reservation of its port that this
        # process holds (Cluster.on_loopback made in this process, the rank started in another) can go
        release_port(self.cluster.addresses[peer.rank])
        return self._describe_link(link)

    def _unlink(self, link: _Link) -> None:
        """Free a link that never became ready (its setup failed)."""
        with self._lock:
            if link.ready.is_set() or self._links.get(link.peer) is not link:
                return
            del self._links[link.peer]
            self._outstanding.pop(link.peer, None)
        for block in (link.rx_message, link.tx_message, link.ring, link.tx_entry):
            self.pool.free(block)

    def _connected(self, peer: int) -> _Link:
        link = self._link(peer)
        if not link.ready.is_set():
            reply = self._peer(peer).call("link", timeout=self.timeout_s, rank=self.rank, **self._describe_link(link))
            self.ledger.add(control_messages=1)
            try:
                described = self._parse_link(reply, want_rank=False)
            except ProtocolError as exc:
                raise PeerError(f"grpc_rdma: {self.peer_name(peer)} answered link with a malformed reply: {exc}") \
                    from None
            self._attach(link, LinkRequest(peer, described.device, described.message, described.ring,
                                           described.slots))
            release_port(self.cluster.addresses[peer])  # it answered: its listener is up (see _on_link)
        return link

    # writing to a peer -----------------------------------------------------

    def _write_entry(self, link: _Link, imm: int, data: np.ndarray | None = None,
                     target: RemoteRegion | None = None) -> None:
        """Deliver immediate ``imm`` to the peer after ``data`` (if any) is at ``target`` (the caller holds
        link.lock): a native write with immediate where the fabric has one (verbs), else the next entry of
        the peer's immediate ring, written after the data, and a doorbell."""
        channel = link.channel
        if self.device.immediates:
            if data is None:
                data, target = link.tx_entry.array[:0], link.peer_ring.at(0, 0)
            self._blocking("writing an immediate", link.peer, channel, channel.write_with_imm, data, target, imm)
            link.written += 1
            return
        slot = link.written % link.slots
        entry = link.tx_entry.array
        entry[:4].view(np.uint32)[0] = imm
        entry[8] = lap(link.written, link.slots)
        ring = link.peer_ring.at(slot * RING_ENTRY, 9)
        if data is None:
            data, target = entry[:0], ring
        self._blocking("writing an immediate", link.peer, channel, channel.write_flagged, data, target, entry[:9],
                       ring)
        self._fabric(channel, channel.notify(), "waking the peer", link.peer)  # its "completion event"
        link.written += 1

    def _post(self, link: _Link, message: Message) -> None:
        """Send a protocol message now if the peer's buffer is idle, else queue it behind the others."""
        with link.lock:
            if link.remote_busy:
                self.messages_queued += 1
            link.queue.append(message)
            if not link.remote_busy:
                self._send_next(link)

    def _send_next(self, link: _Link) -> None:
        with link.lock:
            if link.remote_busy or not link.queue:
                return
            message = link.queue.popleft()
            encode(message, link.tx_message.array)
            link.remote_busy = True
            self.messages_sent[message.type.name] += 1  # counted before the peer can see it and answer
            self.ledger.add(control_messages=1)
            self._write_entry(link, IMM_MESSAGE, link.tx_message.array, link.peer_message)

    def _write_content(self, link: _Link, index: int, source: np.ndarray, addr: int, rkey: bytes) -> None:
        """Write tensor content to where a request asked, then its immediate (the request index)."""
        with link.lock:
            if source.nbytes:
                self._write_entry(link, index, source, RemoteRegion(addr, source.nbytes, rkey))
            else:
                self._write_entry(link, index)

    # sending: passive --------------------------------------------------------

    def _start_send(self, key: Key, array: np.ndarray) -> Future:
        self._check_key(key, "send")
        sent: Future = Future()
        self._outbox.put(key, (contiguous(array, self.ledger), sent))
        return sent

    def _refused(self, key: Key, error: BaseException) -> None:
        # a request for the key (now or later) gets ERROR_STATUS instead of waiting out its timeout
        self._outbox.fail(key, TransportError(str(error)))

    def _on_request(self, link: _Link, message: Message) -> None:
        key = Key(message.name, message.step_id, self.rank, link.peer)
        if not 0 < message.request_index < IMM_ACK:
            raise ProtocolError(f"TENSOR_REQUEST with request index {message.request_index} out of range")
        try:
            waiting = self._outbox.take(key)
        except (ValueError, TransportClosed) as exc:
            self._post(link, Message(MessageType.ERROR_STATUS, message.request_index, name=key.name,
                                     step_id=key.step, error=str(exc)))
            return
        with self._lock:
            self._serving[(link.peer, message.request_index)] = (key, waiting)
        waiting.add_done_callback(lambda done: self._respond(link, message, key, done))

    def _respond(self, link: _Link, request: Message, key: Key, taken: Future) -> None:
        """The tensor for a request is here (or failed): answer with meta-data or write it."""
        index = request.request_index
        # under the link's lock, so that a CANCEL (handled under it too) comes wholly before or after
        with link.lock:
            with self._lock:
                serving = self._serving.pop((link.peer, index), None)
            if serving is None:  # cancelled before the tensor came: keep it for the next request
                if taken.exception() is None:
                    with contextlib.suppress(ValueError, TransportClosed):
                        self._outbox.put(key, taken.result())
                return
            self._respond_now(link, request, key, taken)

    def _respond_now(self, link: _Link, request: Message, key: Key, taken: Future) -> None:
        index = request.request_index
        if taken.exception() is not None:
            self._send_error(link, request, key, taken.exception())
            return
        array, sent = taken.result()
        try:
            meta = TensorMeta.of(array)
            if self.validate or request.meta != meta:
                if len(link.responses) >= link.slots:  # more than the peer may have in flight
                    raise ProtocolError(f"{len(link.responses)} meta-data responses wait for a re-request")
                # keep a clone in registered memory until the re-request says where to write (on the tensor's device,
                # for one this transport moves device to device)
                clone = self._alloc(array.nbytes, None, memory_of(array) if in_device_memory(array) else None)
                self._copy_into(clone, array)
                link.responses[index] = _Response(index, key, clone, meta)
                settle(sent)
                checksum = self._checksum(clone.array) if self.validate else 0
                self._post(link, Message(MessageType.META_DATA_RESPONSE, index, name=key.name, step_id=key.step,
                                         meta=meta, checksum=checksum))
                return
            # counted first: once the immediate is written, the receiver may look at our ledger
            self.ledger.sent(array.nbytes)
            self._write_tensor(link, index, array, request.remote_addr, request.rkey)
            settle(sent)
        except Exception as exc:  # whatever it is, both sides learn of it: nobody waits out a timeout
            settle(sent, error=exc)
            self._send_error(link, request, key, exc)

    # registered memory for a tensor's bytes: the pool's, or a device's ------------------------------------------

    def _alloc(self, nbytes: int, peer: int | None, memory: Memory | None = None) -> Block | DeviceBlock:
        """``nbytes`` of registered memory whose key reaches ``peer`` alone: the pool's, or (``memory``: direct mode,
        a tensor moved device to device) a device block, the one given back last for that peer and size if any."""
        if memory is None:
            return self.pool.alloc(nbytes, peer=peer)
        with self._lock:
            spare = self._spare_blocks.pop((peer, nbytes, memory), None)
        return spare if spare is not None else DeviceBlock(self.device, nbytes, memory, peer)

    def _free(self, block: Block | DeviceBlock) -> None:
        """Give ``block`` back: to the pool, or (a device block) kept for its peer's next request of that size, once
        the work queued on it is done (the peer's next put into it would not wait for that); a device block not
        kept goes with its memory and registration."""
        if isinstance(block, Block):
            self.pool.free(block)
            return
        read_by_now(block.array)
        with self._lock:
            self._spare_blocks.setdefault((block.peer, block.nbytes, block.memory), block)
            while len(self._spare_blocks) > MAX_SPARE_BLOCKS:
                self._spare_blocks.pop(next(iter(self._spare_blocks)))

    def _copy_into(self, block: Block | DeviceBlock, array: Any) -> None:
        """``array``'s bytes copied into ``block``, counted: in host memory, or on the device (finished before the
        block is written from)."""
        flat = array.reshape(-1).view(np.uint8)
        block.array[: array.nbytes][...] = flat
        if isinstance(block, DeviceBlock):
            ready(block.array)
            self.ledger.add(device_to_device_bytes=array.nbytes)
        else:
            self.ledger.add(copied_bytes=array.nbytes)

    def _checksum(self, raw: Any) -> int:
        """CRC-32 of ``raw``'s bytes (``validate``): device memory is checked through a host copy, counted."""
        return zlib.crc32(to_host(raw, self.ledger))

    def _write_tensor(self, link: _Link, index: int, array: np.ndarray, addr: int, rkey: bytes) -> None:
        """Write ``array`` from registered memory: a staging copy (buffered) or the tensor itself (direct)."""
        flat = array.reshape(-1).view(np.uint8) if array.nbytes else np.empty(0, np.uint8)
        if self.mode == "direct":
            # the tensor's own memory: a put's source needs no registration (see FabricTransport.stats)
            self._write_content(link, index, flat, addr, rkey)
            return
        staging = self.pool.alloc(array.nbytes)
        try:
            staging.array[:] = flat
            self.ledger.add(copied_bytes=array.nbytes)
            self._write_content(link, index, staging.array, addr, rkey)
        finally:
            self.pool.free(staging)

    def _on_re_request(self, link: _Link, message: Message) -> None:
        with link.lock:
            response = link.responses.pop(message.request_index, None)
        if response is None:
            raise ProtocolError(f"TENSOR_RE_REQUEST for unknown request {message.request_index}")
        try:
            self.ledger.sent(response.meta.nbytes)
            self._write_content(link, response.index, response.clone.array, message.remote_addr, message.rkey)
        finally:
            self._free(response.clone)

    def _on_cancel(self, link: _Link, message: Message) -> None:
        """The receiver gave up on a request: write nothing more for it, free its clone, confirm."""
        index = message.request_index
        with link.lock:
            with self._lock:
                serving = self._serving.pop((link.peer, index), None)
            if serving is not None:
                self._outbox.forget(*serving)  # if its tensor came meanwhile, _respond parks it again
            response = link.responses.pop(index, None)
            if response is not None:
                self._free(response.clone)
            self._post(link, Message(MessageType.ERROR_STATUS, index, name=message.name, step_id=message.step_id,
                                     error="cancelled by the receiver"))

    def _send_error(self, link: _Link, request: Message, key: Key, error: BaseException) -> None:
        # if the peer is gone too, its own liveness checks will tell it
        with contextlib.suppress(TransportError, FabricError):
            self._post(link, Message(MessageType.ERROR_STATUS, request.request_index, name=key.name,
                                     step_id=key.step, error=f"{type(error).__name__}: {error}"))

    # receiving: initiates ----------------------------------------------------

    def _start_recv(self, key: Key) -> Future:
        """Cancelling the future withdraws the request (its buffer and slot are released)."""
        if self._closed.is_set():
            raise TransportClosed(f"grpc_rdma rank {self.rank} was closed")
        future: Future = Future()
        self._start_request(key, future)
        return future

    def _recv_and_wait(self, key: Key, timeout: float | None) -> np.ndarray:
        """A recv that times out withdraws its request, so nothing of it stays behind."""
        future = self._start_recv(key)
        try:
            return self._wait(future, key, "recv", timeout)
        except TransportTimeout:
            future.cancel()
            raise

    def _abandon(self, peer: int, index: int) -> None:
        """The caller gave up on request ``index`` to ``peer``: withdraw it from the sender, release it once the
        sender confirms."""
        with self._lock:
            request = self._requests.pop((peer, index), None)
            if request is None:
                return  # it completed or failed meanwhile
            self._abandoned[(peer, index)] = request
            link = self._links.get(peer)
        try:
            if link is None:
                raise TransportClosed(f"grpc_rdma rank {self.rank}: no link to rank {peer}")
            self._post(link, Message(MessageType.CANCEL, index, name=request.key.name, step_id=request.key.step))
        except (TransportError, FabricError):  # the peer is gone: nothing more will be written
            self._release_abandoned(peer, index)

    def _release_abandoned(self, peer: int, index: int) -> bool:
        with self._lock:
            request = self._abandoned.pop((peer, index), None)
        if request is None:
            return False
        if request.buffer is not None:
            self._free(request.buffer)
        self._outstanding[peer].release()
        return True

    def _start_request(self, key: Key, future: Future) -> None:
        try:
            link = self._connected(key.src)
            if not self._outstanding[key.src].acquire(timeout=self.timeout_s):
                raise TransportError(f"grpc_rdma: too many requests in flight to {self.peer_name(key.src)}")
            with self._lock:
                lent = self._lent.pop((key.name, key.src), None)
            if lent is not None:  # direct mode: the previous result of this tensor is consumed
                self._free(lent)
            meta = self._meta_cache.get((key.name, key.src))
            request = _Request(next(self._indices), key, future, meta)
            spec = self.placement.spec(key.name, key.src, self.rank)
            request.memory = spec.dst_memory if self.moves_device(spec) else None
            if meta is not None:
                request.buffer = self._alloc(meta.nbytes, key.src, request.memory)
            with self._lock:
                self._requests[(key.src, request.index)] = request
            # by index, not the request: the request holds the future, and a cycle between them would keep
            # every result alive until the cyclic collector ran (which large arrays alone never trigger)
            future.add_done_callback(
                lambda done, peer=key.src, index=request.index: done.cancelled() and self._abandon(peer, index))
            region = request.buffer.remote(0, max(meta.nbytes, 1)) if request.buffer else None
            self._post(link, Message(MessageType.TENSOR_REQUEST, request.index, name=key.name, step_id=key.step,
                                     remote_addr=region.addr if region else 0, rkey=region.rkey if region else b"",
                                     meta=meta))
        except BaseException as exc:
            settle(future, error=exc)

    def _on_meta(self, link: _Link, message: Message) -> None:
        request = self._pending(link, message)
        if request is None:
            return
        if request.re_requested:
            raise ProtocolError(f"a second META_DATA_RESPONSE for request {request.index}")
        meta = message.meta
        if meta.nbytes > memory_bytes():
            self._fail_request(link, request, PeerError(
                f"grpc_rdma: {self.peer_name(link.peer)} announced {request.key} as {meta.dtype} {meta.shape} "
                f"({meta.nbytes} bytes), more than this rank's memory ({memory_bytes()} bytes)"))
            return
        if request.buffer is not None:
            self._free(request.buffer)
            request.buffer = None
        try:
            request.buffer = self._alloc(meta.nbytes, link.peer, request.memory)
        except Exception as exc:  # a size we cannot allocate fails this request, not the poller
            self._fail_request(link, request, PeerError(
                f"grpc_rdma: {self.peer_name(link.peer)} announced {request.key} as {meta.dtype} {meta.shape} "
                f"({meta.nbytes} bytes), which cannot be allocated here: {type(exc).__name__}: {exc}"))
            return
        self._meta_cache[(request.key.name, link.peer)] = meta
        request.re_requested = True
        request.meta = meta
        request.checksum = message.checksum if self.validate else None
        region = request.buffer.remote(0, max(meta.nbytes, 1))
        self._post(link, Message(MessageType.TENSOR_RE_REQUEST, request.index, name=request.key.name,
                                 step_id=request.key.step, remote_addr=region.addr, rkey=region.rkey))

    def _on_content(self, link: _Link, index: int) -> None:
        with self._lock:
            request = self._requests.get((link.peer, index))
            if request is not None and (request.meta is None or request.buffer is None):
                raise ProtocolError(f"content for request {index} before its meta-data")
            request = self._requests.pop((link.peer, index), None)
        if request is None:  # unknown, or abandoned (its CANCEL's confirmation releases it)
            return
        self._outstanding[link.peer].release()
        meta = request.meta
        raw = request.buffer.array[: meta.nbytes]
        if request.checksum is not None and self._checksum(raw) != request.checksum:
            self._free(request.buffer)
            settle(request.future, error=PeerError(
                f"grpc_rdma: {request.key} from {self.peer_name(link.peer)} failed validation: checksum mismatch"))
            return
        if self.mode == "direct":
            result = request.buffer.view(meta.dtype, meta.shape)
            with self._lock:
                self._lent[(request.key.name, link.peer)] = request.buffer
        else:
            result = aligned_empty(meta.shape, meta.dtype)  # 64-byte aligned, so TensorFlow can adopt it without a copy
            result.reshape(-1).view(np.uint8)[:] = raw
            self.ledger.add(copied_bytes=meta.nbytes)
            self._free(request.buffer)
        self.ledger.received(meta.nbytes)
        settle(request.future, result)

    def _fail_request(self, link: _Link, request: _Request, error: PeerError) -> None:
        with self._lock:
            if self._requests.get((link.peer, request.index)) is not request:
                return
            del self._requests[(link.peer, request.index)]
        if request.buffer is not None:
            self._free(request.buffer)
        self._outstanding[link.peer].release()
        settle(request.future, error=error)

    def _on_error(self, link: _Link, message: Message) -> None:
        if self._release_abandoned(link.peer, message.request_index):
            return  # the confirmation of our CANCEL
        request = self._pending(link, message, remove=True)
        if request is not None:
            if request.buffer is not None:
                self._free(request.buffer)
            settle(request.future, error=PeerError(
                f"grpc_rdma: {self.peer_name(link.peer)} failed to send {request.key}: {message.error}"))

    def _pending(self, link: _Link, message: Message, remove: bool = False) -> _Request | None:
        with self._lock:
            key = (link.peer, message.request_index)
            request = self._requests.pop(key, None) if remove else self._requests.get(key)
        if remove and request is not None:
            self._outstanding[link.peer].release()
        return request

    # the poller: the emulated completion queue --------------------------------

    def _poll(self) -> None:
        idle_since = time.perf_counter()
        backoff = 20e-6
        next_check = time.monotonic() + LIVENESS_EVERY_S
        while not self._closed.is_set():
            with self._lock:
                links = [link for link in self._links.values() if link.ready.is_set()]
            if self.device.immediates:
                handled = self._take_immediates(links)
            else:
                handled = sum(self._drain(link) for link in links)
            if handled:
                idle_since, backoff = time.perf_counter(), 20e-6
                continue
            if time.perf_counter() - idle_since < self.poller_spin_s:
                os.sched_yield()  # let the other threads have the GIL while we spin
                continue
            if time.monotonic() > next_check:
                next_check = time.monotonic() + LIVENESS_EVERY_S
                self._check_waiting_peers()
            self.device.wait_for_activity(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _drain(self, link: _Link) -> int:
        handled = 0
        ring = link.ring.array
        while True:
            slot = (link.read % link.slots) * RING_ENTRY
            if ring[slot + 8] != lap(link.read, link.slots):
                return handled
            imm = int(ring[slot : slot + 4].view(np.uint32)[0])
            link.read += 1
            handled += 1
            self._handle(link, imm)

    def _take_immediates(self, links: list[_Link]) -> int:
        """Handle the immediates the fabric delivered natively; those of a peer whose link is not ready
        yet (it wrote as soon as its side was linked) wait for it, in order."""
        by_device = {tuple(link.attached.device): link for link in links}
        waiting, handled = [], 0
        for peer, imm in [*self._early_immediates, *self.device.take_immediates()]:
            link = by_device.get(tuple(peer))
            if link is None:
                waiting.append((peer, imm))
                continue
            link.read += 1
            handled += 1
            self._handle(link, imm)
        self._early_immediates = waiting
        return handled

    def _handle(self, link: _Link, imm: int) -> None:
        try:
            self._dispatch(link, imm)
        except Exception as exc:  # nothing a peer sends may stop the poller
            self._fail_peer(link.peer, PeerError(f"grpc_rdma: protocol failure with "
                                                 f"{self.peer_name(link.peer)}: {type(exc).__name__}: {exc}"))

    def _dispatch(self, link: _Link, imm: int) -> None:
        if imm == IMM_ACK:
            with link.lock:
                link.remote_busy = False
                self._send_next(link)
        elif imm == IMM_MESSAGE:
            message = parse(link.rx_message.array)
            with link.lock:  # the buffer is free for the peer's next message
                self._write_entry(link, IMM_ACK)
                self.messages_sent["ACK"] += 1
            handler = {
                MessageType.TENSOR_REQUEST: self._on_request,
                MessageType.META_DATA_RESPONSE: self._on_meta,
                MessageType.TENSOR_RE_REQUEST: self._on_re_request,
                MessageType.ERROR_STATUS: self._on_error,
                MessageType.CANCEL: self._on_cancel,
            }[message.type]
            handler(link, message)
        else:
            self._on_content(link, imm)

    def _check_waiting_peers(self) -> None:
        with self._lock:
            peers = {peer for peer, _ in self._requests} | {peer for peer, _ in self._abandoned}
            peers |= {link.peer for link in self._links.values() if link.responses}
            linked = {link.peer for link in self._links.values() if link.ready.is_set()}
        # sends waiting for a receiver that linked with us: it ran, so one that now refuses is gone
        peers |= {key.dst for key in self._outbox.parked_keys()} & linked
        for peer in peers:
            if not self._peer(peer).alive():
                error = PeerError(
                    f"grpc_rdma: {self.peer_name(peer)} does not answer on the control path (the process is gone?)")
                self._fail_peer(peer, error)
                for key, (_array, sent) in self._outbox.drop(lambda key, peer=peer: key.dst == peer):
                    settle(sent, error=PeerError(f"grpc_rdma: sending {key} failed: {error}"))

    def _fail_peer(self, peer: int, error: PeerError) -> None:
        """Fail everything waiting on ``peer``; release what was kept for it (it writes nothing more)."""
        with self._lock:
            failed = [key for key in self._requests if key[0] == peer]
            requests = [self._requests.pop(key) for key in failed]
            abandoned = [index for p, index in self._abandoned if p == peer]
            link = self._links.get(peer)
        for request in requests:
            if request.buffer is not None:
                self._free(request.buffer)
            self._outstanding[peer].release()
            settle(request.future, error=error)
        for index in abandoned:
            self._release_abandoned(peer, index)
        if link is not None:
            with link.lock:
                responses, link.responses = list(link.responses.values()), {}
            for response in responses:
                self._free(response.clone)
