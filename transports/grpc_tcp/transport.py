"""gRPC over TCP, the way TensorFlow's default distributed runtime moves tensors.

Send is passive: the tensor is parked in a local rendezvous table under its
key. Receive initiates: it calls ``RecvTensor`` on the sender, whose handler
waits for the tensor if the request came first (tag matching) and streams
it back as ``TensorChunk`` messages (see ``wire.py``). Every call carries the
run's token; the server refuses one without it before parsing the request or
touching the rendezvous table (``transports/auth.py``).

Configured as a careful engineer would: message size limits lifted, no
compression, keepalive so a vanished peer is noticed, tensors over 16 MiB
streamed in 16 MiB chunks (``wire.DEFAULT_CHUNK_BYTES`` says why). Copies of
the payload in user space, per transfer:

* sender: one join of header and payload into the message ``bytes``
  (grpcio's Python API takes only ``bytes``), and one by grpcio itself,
  which copies every message into a core slice
  (``_slice_from_bytes`` -> ``grpc_slice_from_copied_buffer``);
* receiver: one by grpcio, which copies each received message out of its
  slices into a ``bytes`` object; the tensor is then a zero-copy view of it
  (plus one assembling copy when the tensor came in several chunks).

All of them are recorded in the ledger.

The receiver trusts no sender's description of a tensor: before it allocates, the dtype, shape and size
a chunk announces must be consistent, within this machine's memory, and (for a tensor the plan gives a
shape) exactly the planned ones (``wire.py``); anything else fails that receive with a PeerError naming
the sender, and the transport goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import Future

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from transports.auth import LISTENER_OPTIONS, AioTokenCheck, call_metadata
from transports.base import (
    DEFAULT_TIMEOUT_S,
    Cluster,
    Key,
    PeerError,
    Transport,
    TransportClosed,
    TransportError,
    TransportTimeout,
    key_problem,
)
from transports.common import settle
from transports.grpc_tcp.tensor_pb2 import DESCRIPTOR, RecvTensorRequest
from transports.grpc_tcp.wire import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, TensorAssembler, WireError, encode_chunks
from transports.ports import release_cluster_ports, release_port
from transports.rendezvous import Rendezvous
from transports.tensors import contiguous

_SERVICE = DESCRIPTOR.services_by_name["TensorTransport"]
RECV_TENSOR = f"/{_SERVICE.full_name}/RecvTensor"

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
#: the server receives only RecvTensorRequests (a name of at most MAX_NAME_BYTES and three integers):
#: a limit sized to them, so that a caller cannot make it buffer a huge message; only clients,
#: which receive tensors, lift theirs
MAX_REQUEST_BYTES = 4096
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    # never share a port silently with another process
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    *LISTENER_OPTIONS,
]
#: how often a sender whose tensors wait for a receiver checks that the receiver still lives
LIVENESS_EVERY_S = 1.0
#: RecvTensor calls a receiver starts towards one sender before the sender's server has taken the earlier ones
#: (the call's initial metadata): gRPC's server cancels calls beyond 1000 it holds untaken
#: (``grpc.server.max_pending_requests``), which a recv_many of more keys than that reached in one burst. A
#: call taken no longer counts, however long it then waits for its tensor, so no number of keys deadlocks.
CALLS_STARTING = 100


class GrpcTcpTransport(Transport):
    """TensorFlow-style RecvTensor over gRPC and TCP; one asyncio loop thread per transport."""

    name = "grpc_tcp"
    completes_on_threads = True  # the asyncio loop's thread serves RecvTensor

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        super().__init__(timeout_s=timeout_s)
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"grpc_tcp: chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._receiving: set[Future] = set()
        #: ranks heard from (they called RecvTensor here, or answered ours): one that now refuses is dead
        self._heard: set[int] = set()
        self._watchdog: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        #: per sender, the RecvTensor calls that may be starting at once (CALLS_STARTING; made on the loop)
        self._starting: dict[int, asyncio.Semaphore] = {}
        self._lock = threading.Lock()
        self._closed = False

    # lifecycle -------------------------------------------------------------

    def start(self, cluster: Cluster, rank: int) -> None:
        if not 0 <= rank < cluster.size:
            raise ValueError(f"grpc_tcp: rank {rank} is not in a cluster of {cluster.size}")
        self.cluster, self.rank = cluster, rank
        self._metadata = call_metadata(cluster.token)
        self._outbox = Rendezvous(f"grpc_tcp rank {rank}")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"grpc_tcp-{rank}", daemon=True)
        self._thread.start()
        try:
            self._run(self._start_server(cluster.addresses[rank], cluster.token))
        except BaseException:
            self.close()
            raise

    async def _start_server(self, address: str, token: str) -> None:
        check = AioTokenCheck(token, f"grpc_tcp rank {self.rank}")
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=(check,))
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    _SERVICE.full_name,
                    {
                        # the request stays bytes: _serve_recv_tensor parses it and names the caller if it cannot
                        "RecvTensor": grpc.unary_stream_rpc_method_handler(self._serve_recv_tensor)
                    },
                ),
            )
        )
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise TransportError(f"grpc_tcp: cannot listen on {address} ({exc}); is the port in use?") from None
        if port == 0:
            raise TransportError(f"grpc_tcp: cannot listen on {address}; is the port in use?")
        await server.start()
        self._server = server
        release_port(address)  # our listener holds the port now
        self._watchdog = asyncio.get_running_loop().create_task(self._watch_receivers())

    async def _watch_receivers(self) -> None:
        """Fail the sends waiting for a receiver that called here before and now refuses connections.

        A receiver that is slow (busy machine) still holds its listening port and keeps its tensors
        waiting until the caller's timeout; only one whose port refuses (its process is gone) is dead.
        """
        while True:
            await asyncio.sleep(LIVENESS_EVERY_S)
            try:
                await self._check_receivers()
            except Exception:  # a failed check is retried; the sends' own timeouts still bound them
                continue

    async def _check_receivers(self) -> None:
        waiting = {key.dst for key in self._outbox.parked_keys()} & self._heard
        for rank in sorted(waiting):
            if await _refuses(self.cluster.addresses[rank]):
                peer = self.peer_name(rank)
                for key, (_array, sent) in self._outbox.drop(lambda key, rank=rank: key.dst == rank):
                    settle(sent, error=PeerError(
                        f"grpc_tcp: sending {key} to {peer} failed: the receiver is gone (it asked for "
                        f"tensors before and its port {self.cluster.addresses[rank]} now refuses connections)"))

    def close(self) -> None:
        with self._lock:
            if self._closed or self._loop is None:
                self._closed = True
                return
            self._closed = True
            receiving, self._receiving = set(self._receiving), set()
        closed = TransportClosed(f"grpc_tcp rank {self.rank} was closed")
        for _array, sent in self._outbox.close():
            settle(sent, error=closed)
        for future in receiving:
            settle(future, error=closed)
        try:  # the streams still in flight finish first, within a send's own time (see _shutdown)
            self._run(self._shutdown(), timeout=self.timeout_s + 10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            release_cluster_ports(self.cluster.addresses)

    async def _shutdown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        tasks, self._tasks = self._tasks, set()
        for task in tasks:
            task.cancel()
        # dropped, not only closed: gRPC's core (its poller, sockets and threads) lives as long as
        # any channel or server object does, and this transport object may outlive its close()
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(grace=None)
        server, self._server = self._server, None
        if server is not None:
            # a send is done once its bytes are handed to gRPC, not once they arrived: a stream still draining to
            # its receiver (a 16 MiB chunk takes 0.13 s at 1 Gbit/s, several wait behind it) finishes before the
            # server goes, as a receiver still reading is not a failure; a receiver gone ends its stream at once
            await server.stop(grace=self.timeout_s)

    def _run(self, coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    # sending: passive ------------------------------------------------------

    def _start_send(self, key: Key, array: np.ndarray) -> Future:
        self._check_key(key, "send")
        sent: Future = Future()
        self._outbox.put(key, (contiguous(np.asarray(array), self.ledger), sent))
        return sent

    async def _serve_recv_tensor(self, payload: bytes, context: grpc.aio.ServicerContext):
        try:
            request = RecvTensorRequest.FromString(payload)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"grpc_tcp rank {self.rank}: malformed RecvTensorRequest from {context.peer()}: {exc}")
        key = Key(request.name, request.step, request.src, request.dst)
        problem = key_problem(key)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"grpc_tcp rank {self.rank}: RecvTensor from {context.peer()}: {problem}")
        if key.src != self.rank or not 0 <= key.dst < self.cluster.size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{key} asked of rank {self.rank}")
        if key.dst not in self._heard:
            self._heard.add(key.dst)
            release_port(self.cluster.addresses[key.dst])  # it called us, so its listener is up (see _channel)
        try:
            waiter = self._outbox.take(key)
        except (TransportClosed, ValueError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if not waiter.done():  # the receiver learns its call is taken (see CALLS_STARTING); else the tensor says so
            await context.send_initial_metadata(())
        try:
            array, sent = await asyncio.wrap_future(waiter)
        except asyncio.CancelledError:
            self._outbox.forget(key, waiter)
            raise
        except TransportClosed as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except TransportError as exc:  # the send was refused here (_refused): say why, the receiver need not wait
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        self.ledger.add(serialisations=1, tensors_sent=1, payload_bytes_sent=array.nbytes)
        # grpcio copies each yielded message into a core slice
        self.ledger.add(copied_bytes=array.nbytes)
        chunks = encode_chunks(array, self.ledger, self.chunk_bytes)
        chunks_sent = 0
        try:
            message = next(chunks)
            for following in chunks:
                yield message
                chunks_sent += 1
                message = following
            settle(sent)  # every byte of `array` has been copied into a message
            yield message
        except (GeneratorExit, asyncio.CancelledError):
            # gRPC closes the stream when the receiver cancels its call or its connection drops
            handed = min(array.nbytes, chunks_sent * self.chunk_bytes)
            settle(sent, error=PeerError(
                f"grpc_tcp: sending {key} to {self.peer_name(key.dst)} failed: the receiver went away (it cancelled "
                f"the call or its connection closed) with {handed} of {array.nbytes} bytes handed to gRPC"))
            raise
        except BaseException as exc:
            settle(sent, error=PeerError(
                f"grpc_tcp: sending {key} to {self.peer_name(key.dst)} failed: {type(exc).__name__}: {exc}"))
            raise

    def _refused(self, key: Key, error: BaseException) -> None:
        self._outbox.fail(key, TransportError(f"grpc_tcp: {self.peer_name(key.src)} failed to send {key}: {error}"))

    # receiving: initiates the call -----------------------------------------

    def _start_recv(self, key: Key) -> Future:
        received: Future = Future()
        with self._lock:
            if self._closed:
                raise TransportClosed(f"grpc_tcp rank {self.rank} was closed")
            self._receiving.add(received)
        # `received` and the fetch's future each hold a callback naming the other. Were that a cycle, every
        # tensor (the result both hold) would stay alive until the cyclic collector ran, which arrays alone
        # never trigger: the receiver grew by whole tensors, to the OOM killer in training. So `abandon` reaches
        # the fetch through `fetching`, emptied once the fetch is done, and only reference counts free the tensor.
        fetching = [asyncio.run_coroutine_threadsafe(self._fetch(key), self._loop)]

        def finish(task: Future) -> None:
            fetching.clear()
            with self._lock:
                self._receiving.discard(received)
            if task.cancelled():
                settle(received, error=TransportClosed(f"grpc_tcp: recv of {key} was cancelled"))
            elif task.exception() is not None:
                settle(received, error=task.exception())
            else:
                settle(received, task.result())

        def abandon(result: Future) -> None:
            if result.cancelled():
                for task in fetching[:]:  # a copy: `finish` may empty it meanwhile, on the loop's thread
                    task.cancel()

        fetching[0].add_done_callback(finish)
        received.add_done_callback(abandon)
        return received

    def _channel(self, rank: int) -> grpc.aio.Channel:
        if rank not in self._channels:
            channel = grpc.aio.insecure_channel(self.cluster.addresses[rank], options=CHANNEL_OPTIONS)
            self._channels[rank] = channel
            self._tasks.add(asyncio.get_running_loop().create_task(self._release_when_up(rank, channel)))
        return self._channels[rank]

    async def _release_when_up(self, rank: int, channel: grpc.aio.Channel) -> None:
        """Once connected, the peer's listener is up: drop the port reservation this process may hold for it.

        ``Cluster.on_loopback`` reserves every rank's port in the process that made the cluster; a rank
        in another process cannot release it, so whoever reaches that rank first does.
        """
        with contextlib.suppress(Exception):
            await channel.channel_ready()
            release_port(self.cluster.addresses[rank])

    async def _fetch(self, key: Key) -> np.ndarray:
        peer = self.peer_name(key.src)
        deadline = time.monotonic() + self.timeout_s
        # a sender not heard from yet may still be starting: the call waits for it (up to the timeout); one that
        # answered before is not waited for: if its port refuses connections it is gone, and the call fails at once
        ready = key.src not in self._heard
        starting = self._starting.get(key.src)
        if starting is None:
            starting = self._starting[key.src] = asyncio.Semaphore(CALLS_STARTING)
        while True:
            async with starting:  # until the sender's server has taken the call (or it failed)
                call = self._channel(key.src).unary_stream(
                    RECV_TENSOR, request_serializer=RecvTensorRequest.SerializeToString
                )(
                    RecvTensorRequest(name=key.name, step=key.step, src=key.src, dst=key.dst),
                    timeout=max(deadline - time.monotonic(), 0.001),
                    metadata=self._metadata,
                    wait_for_ready=ready,
                )
                try:
                    await call.initial_metadata()  # taken: the sender is there
                    break
                except grpc.aio.AioRpcError as exc:
                    if ready or exc.code() != grpc.StatusCode.UNAVAILABLE:
                        break  # its error comes again from the stream below
                    call.cancel()
                if await _refuses(self.cluster.addresses[key.src]):
                    raise PeerError(f"grpc_tcp: recv of {key} from {peer} failed: the sender is gone (it answered "
                                    f"before and its port {self.cluster.addresses[key.src]} now refuses "
                                    "connections)") from None
                ready = True  # it holds its port: alive, however slowly it accepts; wait for it after all
        spec = self.placement.spec(key.name, key.src, key.dst)
        # as zerocopy's static placement: a tensor the plan gives a shape must arrive as planned
        planned = (spec.dtype, spec.shape) if spec is not None and spec.shape is not None else None
        assembler = TensorAssembler(self.ledger, expected=planned)
        error: TransportError | None = None
        try:
            async for message in call:
                self._heard.add(key.src)
                assembler.add(message)
            array = assembler.result()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                error = TransportTimeout(
                    f"grpc_tcp: recv of {key} from {peer} did not complete within {self.timeout_s:g} s")
            else:
                error = PeerError(f"grpc_tcp: recv of {key} from {peer} failed: {exc.code().name}: {exc.details()}")
        except WireError as exc:
            error = PeerError(f"grpc_tcp: refused what {peer} sent for {key}: {exc}")
        except BaseException:
            call.cancel()  # cancelled (the caller gave up, or close()): the sender learns at once
            raise
        if error is not None:
            # raised outside the handler, with the call finished and dropped: neither the error's
            # traceback nor its context keeps gRPC's call (and with it the connection) alive
            call.cancel()
            del call, assembler  # nor does the half-built tensor stay alive with the error
            raise error
        # grpcio copied the payload out of its slices into the message bytes
        self.ledger.add(
            copied_bytes=array.nbytes,
            deserialisations=1,
            tensors_received=1,
            payload_bytes_received=array.nbytes,
        )
        return array


async def _refuses(address: str, timeout: float = 1.0) -> bool:
    """Whether nothing listens at ``host:port`` any more: a refused connection (a timeout is a busy host)."""
    host, _, port = address.rpartition(":")
    try:
        _reader, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), timeout)
    except TimeoutError:
        return False
    except (OSError, ValueError):
        return True
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False

