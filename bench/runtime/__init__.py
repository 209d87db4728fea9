"""The training runtime: parameter-server data parallelism over any transport (the paper's section 5.2 setup).

``servers`` servers each run a worker and a parameter server (PS) process.
Trainable variables are placed round-robin over the PS processes. Every step:

* each PS sends its variables' current values to every worker;
* each worker receives them (all receives of a step posted together,
  ``Transport.recv_many``), computes gradients on its own synthetic batch,
  and sends each gradient to the variable's PS;
* each PS sums the gradients of all workers and applies SGD
  (``w -= lr * mean(g)``): synchronous training. With ``asynchronous`` the PS
  serves each worker on its own, applying every gradient as it arrives, so
  workers never wait for each other.

The model is TensorFlow's or PyTorch's: the runtime imports neither, and asks the
workload's framework (``bench.runtime.framework``) to build it, analyse it and run
its step. Zero copy through either: received weights enter the model through DLPack
(TensorFlow's ``stateless_call`` takes tensors instead of variables; PyTorch's
parameters are set over the received memory), so a weight written by the transport
into registered memory is used in place. Gradients leave from the framework's own
buffers through DLPack. Where a tensor cannot cross without a copy (read-only or
misaligned memory: TensorFlow needs 64-byte alignment), the runtime copies it and
counts the bytes.

Device memory (``memory`` ``cuda``, PyTorch's models): every tensor of the plan lives on the GPU at both ends
(``Plan.specs(rank, memory)``), so the transport receives weights into device memory, the model computes over them
there and hands its gradients out from autograd's device memory (CuPy arrays through DLPack); a parameter server's
weights are device memory and it applies SGD with CuPy. A transport that moves device memory itself (zerocopy and
rdma_cp where the fabric has UCX's CUDA transports) puts device to device; the others stage through the host, each
crossing counted in the ledger (``device_to_host_bytes``, ``host_to_device_bytes``).

A module per role: ``config`` (the run's config, step times, the model built and analysed alike for every role),
``worker`` (a worker's loop, its step's sends, real or replayed compute), ``ps`` (a parameter server's loop),
``local`` (the Local line), ``update`` (the update math the servers and the Local line share), ``stopping`` (where
a run's steps end); beside them the graph analyzer (``analyzer``), allocation-site tracing (``sites``), the
workload (``workload``) and the frameworks (``framework`` and its bridges).
"""
