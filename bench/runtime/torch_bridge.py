"""PyTorch behind the framework seam (``bench.runtime.framework``).

A worker's step sets every parameter's and buffer's ``.data`` over the received arrays' memory (``torch.from_numpy``:
no copy; the transport wrote the weights there, and the model computes with them in place), runs the forward and
backward pass under autograd, and hands the gradients out as NumPy views of autograd's own buffers. As DDP does, a
hook per parameter (``register_post_accumulate_grad_hook``, or ``Tensor.register_hook`` on a torch without it)
fills buckets of about ``GRADIENT_BUCKET_BYTES``, last layers first; a bucket whose every gradient is in goes to
``on_gradients`` while the rest of the backward pass runs.

State (BatchNorm's running statistics, its batch count) is updated by the forward pass in place: a worker's
buffers are copies of the received values (counted), so that what came in stays what the parameter server sent.

Where what a worker sends lives (host memory): as DDP's ``gradient_as_bucket_view``, each dense gradient is a view
of an anonymous mapping the step keeps (zeroed at the start of a step; autograd accumulates into it in place), and
so is each buffer's copy. The runtime registers that mapping with the fabric once (``bench.runtime.sites``), as it
registers TensorFlow's BFC regions, and every later send is a registration-cache hit. Left where autograd and NumPy
put them (the C library's main heap, ``[heap]``, which is not registered whole), each of inception_v3's 472 tensors
missed every step and the runtime looked for its region again: 40 ms of a step's communication. A mapping is
written again only once every array handed out of it is gone (weak references), so a step's results stay valid as
long as a caller holds them: the runtime's worker, which holds a step's until the next step's are in, takes two
mappings in turns (made together, in one region); the local line holds one per worker of a step. Past
:data:`MAPPINGS` in use, gradients are made afresh (``grad`` set to None first) and a buffer's copy by NumPy, as in
device memory.

Device memory (``--memory cuda``): the model computes on the GPU, its parameters' ``.data`` over the received
CuPy arrays (``torch.from_dlpack``: no copy) and its gradients handed out as CuPy arrays over autograd's device
memory (DLPack, which orders the consumer's stream after PyTorch's). Each step's batch is copied to the device
(the input pipeline's copy, not the runtime's); a buffer's copy is made on the device. A sparse gradient's rows
are gathered in host memory only: such a model is refused on a device before the run starts.

Variables in a stable order: the trainable parameters in ``named_parameters()`` order, then the buffers (state),
the split Keras makes between trainable and non-trainable variables. An ``nn.Embedding(sparse=True)`` gives a
sparse gradient: its rows and their indices, at most as many rows as the batch looks up (the plan's bound).
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.runtime.analyzer import Output, Plan, Variable, gradient_buckets, plan_from
from bench.runtime.framework import Framework, OnGradients, SparseGradient, Step, StepResult
from transports.memory import HOST, Memory, cuda_problem
from transports.tensors import adopt, as_framework

#: at most this many mappings per step function hold gradients and state: the runtime's worker takes two in turns,
#: the local line one per worker of a step (see the module)
MAPPINGS = 4
#: where autograd allocates a parameter's gradient (made afresh each step: ``grad`` is None before the backward pass)
GRADIENT_SITE = "autograd: AccumulateGrad of"
#: where the forward pass leaves a buffer's new value (in the worker's copy of the received value)
STATE_SITE = "forward pass: buffer updated in place:"


class Torch(Framework):
    """``torch.nn`` models on PyTorch (see the module)."""

    name = "torch"
    distributions = ("torch",)

    def use_cores(self, cores: int) -> None:
        """PyTorch's intra-op threads (OpenMP: they spin between operations) on ``cores`` cores, unless the user set
        ``OMP_NUM_THREADS``: on 2 cores a worker and a parameter server each with 2 threads ran a step 2.5 times
        slower than with one each."""
        import torch

        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, cores))

    def memory_problem(self, memory: Memory) -> str | None:
        """Device memory needs a CUDA build of torch that sees that device, and what the transports need for it
        (CuPy, the driver: ``transports.memory.cuda_problem``)."""
        import torch

        if not memory.is_device:
            return None
        if not torch.cuda.is_available() or memory.device >= torch.cuda.device_count():
            return (f"--memory {memory}: the torch here ({torch.__version__}) sees {torch.cuda.device_count()} CUDA "
                    "device(s) (a CPU build, or no GPU): run on a machine with an NVIDIA GPU and a CUDA build of "
                    "torch, or leave --memory out")
        problem = cuda_problem(memory)
        return None if problem is None else f"--memory {memory}: {problem}"

    def build(self, workload: Any, seed: int, memory: Memory = HOST) -> Any:
        """The model, built on the host (the same initial values wherever it computes) and moved to ``memory``."""
        import torch

        torch.manual_seed(seed)
        model = workload.build()
        model.train()
        return model.to(_device(memory)) if memory.is_device else model

    def initial_values(self, model: Any) -> list[np.ndarray]:
        return [tensor.detach().cpu().numpy().copy() for _, tensor in _trainable(model) + _state(model)]

    def analyze(self, name: str, model: Any, workload: Any, x: np.ndarray, y: np.ndarray, servers: int,
                batch_size: int) -> Plan:
        """One step traced under autograd: each gradient's shape (a sparse one's rows: the bound) and each
        buffer's, as the plan needs them."""
        parameters, buffers = _trainable(model), _state(model)
        for _, parameter in parameters:
            parameter.grad = None
        loss = workload.loss_fn()(_tensor(y), model(_tensor(x)))
        loss.backward()
        sparse_rows: dict[int, int] = {}
        outputs: dict[int, Output] = {}
        for index, (path, parameter) in enumerate(parameters):
            gradient = parameter.grad
            if gradient is None:
                raise ValueError(f"parameter '{path}' has no gradient after a step: the loss does not depend on it; "
                                 "the runtime sends every parameter's gradient (freeze it with requires_grad=False)")
            if gradient.is_sparse:
                sparse_rows[index] = int(gradient._values().shape[0])
                outputs[index] = Output(None, _numpy_dtype(gradient.dtype), "",
                                        _numpy_dtype(gradient._indices().dtype))
            else:
                outputs[index] = Output(tuple(gradient.shape), _numpy_dtype(gradient.dtype), f"{GRADIENT_SITE} {path}")
            parameter.grad = None
        for offset, (path, buffer) in enumerate(buffers):
            outputs[len(parameters) + offset] = Output(tuple(buffer.shape), _numpy_dtype(buffer.dtype),
                                                       f"{STATE_SITE} {path}")
        variables = [Variable(index, path, tuple(tensor.shape), _numpy_dtype(tensor.dtype), index < len(parameters),
                              sparse_rows.get(index, 0))
                     for index, (path, tensor) in enumerate(parameters + buffers)]
        return plan_from(name, variables, outputs, servers, batch_size)

    def step(self, model: Any, workload: Any, plan_variables: list[Variable],
             on_gradients: OnGradients | None = None) -> Step:
        return _TorchStep(model, workload.loss_fn(), on_gradients)

    def predictor(self, model: Any, workload: Any, trainable: int) -> Callable[[list[np.ndarray]],
                                                                               Callable[[np.ndarray], np.ndarray]]:
        import torch

        parameters = [parameter for _, parameter in _trainable(model)]

        def with_weights(weights: list[np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
            for parameter, weight in zip(parameters, weights, strict=True):
                parameter.data = torch.from_numpy(weight.copy())  # the transport may write the next step's weights

            def predict(x: np.ndarray) -> np.ndarray:
                model.eval()
                try:
                    with torch.no_grad():
                        return model(_tensor(x)).numpy()
                finally:
                    model.train()

            return predict

        return with_weights


class _TorchStep(Step):
    """A worker's step (see the module)."""

    def __init__(self, model: Any, loss: Any, on_gradients: OnGradients | None) -> None:
        self._model, self._loss, self._on_gradients = model, loss, on_gradients
        self._parameters = [parameter for _, parameter in _trainable(model)]
        #: a GPU where the model computes in device memory, else None
        self._device = next((p.device for p in self._parameters if p.device.type != "cpu"), None)
        self._buffers = [buffer for _, buffer in _state(model)]
        #: host memory: the mappings a step's gradients and buffers' copies lie in (see the module); none on a device
        self._held: list[_Held] = []
        #: the one this step uses (None: a device's step, or none made yet)
        self._holding: _Held | None = None
        self._buckets: list[list[int]] = []
        self._waiting: dict[int, set[int]] = {}
        self._bucket_of: dict[int, int] = {}
        #: this step's gradients handed in so far, by position (the tensors a bucket's arrays are views of)
        self._arrived: dict[int, Any] = {}
        if on_gradients is not None:
            for position, parameter in enumerate(self._parameters):
                _on_gradient(parameter, lambda gradient, position=position: self._gradient_in(position, gradient))

    def __call__(self, values: list[np.ndarray], x: np.ndarray, y: np.ndarray, copies: Any) -> StepResult:
        trainable = len(self._parameters)
        holding = self._holding = self._free_mapping() if self._device is None else None
        for parameter, value in zip(self._parameters, values[:trainable], strict=True):
            parameter.data = self._over(copies.adoptable(value, 1))
            parameter.grad = None
        if holding is not None:
            for parameter, gradient in zip(self._parameters, holding.gradients, strict=True):
                if gradient is not None:
                    gradient.zero_()  # no array handed out of it is alive (see the module)
                    parameter.grad = gradient
        for position, (buffer, value) in enumerate(zip(self._buffers, values[trainable:], strict=True)):
            copies.bytes += value.nbytes  # the forward pass writes it: the received value stays as it came
            if holding is not None:
                held = holding.state[position]
                held.numpy()[...] = value
                buffer.data = held
            else:
                buffer.data = self._over(np.array(value)) if self._device is None else self._over(value).clone()
        if self._on_gradients is not None:
            self._start_buckets()
        x, y = _tensor(x), _tensor(y)
        if self._device is not None:  # the step's batch onto the GPU (the input pipeline's copy)
            x, y = x.to(self._device), y.to(self._device)
        loss = self._loss(y, self._model(x))
        loss.backward()
        gradients: list[np.ndarray | SparseGradient] = []
        for parameter in self._parameters:
            gradient = parameter.grad
            if gradient.is_sparse:
                gradients.append(SparseGradient(gradient._values().numpy(), gradient._indices()[0].numpy()))
            else:
                gradients.append(self._out(gradient))
        return StepResult(loss.detach(), gradients, [self._out(buffer) for buffer in self._buffers])

    def _free_mapping(self) -> _Held | None:
        """Host memory for this step's gradients and buffers' copies: a mapping made before whose arrays handed out
        are all gone (the runtime's worker is done with a step's before the next: two take turns), or a new one; None
        when :data:`MAPPINGS` are in use (autograd's and NumPy's memory then, made afresh)."""
        for held in self._held:
            if held.free():
                return held
        if len(self._held) >= MAPPINGS:
            return None
        dense = [parameter for parameter in self._parameters if not _sparse_gradient(parameter)]
        made = []
        for tensors in map(iter, _one_mapping(dense + self._buffers, 2)):  # two: the worker's turns, one region
            made.append(_Held([None if _sparse_gradient(parameter) else next(tensors)
                               for parameter in self._parameters], list(tensors)))
        self._held += made
        return made[0]

    def _out(self, tensor: Any) -> Any:
        """``tensor`` handed out (see :func:`_out`), its array remembered by the mapping it lies in."""
        array = _out(tensor)
        if self._holding is not None:
            self._holding.handed_out.append(weakref.ref(array))
        return array

    def _over(self, value: Any) -> Any:
        """A tensor over a received array's memory (NumPy's on the host, CuPy's on the model's GPU): no copy."""
        import torch

        return torch.from_numpy(value) if self._device is None else as_framework(value, "torch")

    def _start_buckets(self) -> None:
        """This step's buckets: the dense gradients' (their sizes are the parameters'), each waiting for all its
        gradients; made once, reset every step."""
        if not self._buckets:
            sizes = [None if _sparse_gradient(parameter) else parameter.numel() * parameter.element_size()
                     for parameter in self._parameters]
            self._buckets = gradient_buckets(sizes)
            self._bucket_of = {position: number for number, bucket in enumerate(self._buckets)
                               for position in bucket}
        self._waiting = {number: set(bucket) for number, bucket in enumerate(self._buckets)}
        self._arrived = {}

    def _gradient_in(self, position: int, gradient: Any) -> None:
        """Autograd has computed the gradient at ``position``: hand its bucket over once every gradient of it
        is in."""
        number = self._bucket_of.get(position)
        if number is None:
            return
        self._arrived[position] = gradient
        waiting = self._waiting[number]
        waiting.discard(position)
        if not waiting:
            bucket = self._buckets[number]
            self._on_gradients(bucket, [self._out(self._arrived.pop(i)) for i in bucket])


class _Held:
    """One anonymous mapping a step's gradients and buffers' copies lie in (:func:`_one_mapping`), and the arrays
    handed out of it: it is written again only once every one of them is gone."""

    def __init__(self, gradients: list[Any], state: list[Any]) -> None:
        #: each parameter's gradient tensor (None: a sparse gradient, made by autograd), each buffer's copy
        self.gradients, self.state = gradients, state
        self.handed_out: list[weakref.ref] = []

    def free(self) -> bool:
        """Whether no array handed out of this mapping is alive (then it is taken for a step)."""
        if any(ref() is not None for ref in self.handed_out):
            return False
        self.handed_out = []
        return True


def _on_gradient(parameter: Any, call: Callable[[Any], None]) -> None:
    """Call ``call(gradient)`` once autograd has computed ``parameter``'s gradient of a step: after it is
    accumulated into ``parameter.grad`` (``register_post_accumulate_grad_hook``), or, on a torch without that hook,
    as it is handed to the accumulation (the step's one gradient of that parameter: ``grad`` is None before the
    backward pass, or, in host memory, the step's zeroed mapping it is added into, so the values are the same)."""
    if hasattr(parameter, "register_post_accumulate_grad_hook"):
        parameter.register_post_accumulate_grad_hook(lambda accumulated: call(accumulated.grad))
        return

    def before(gradient: Any) -> Any:
        call(gradient)
        return gradient

    parameter.register_hook(before)


def _one_mapping(tensors: list[Any], sets: int) -> list[list[Any]]:
    """``sets`` times a host tensor shaped like each of ``tensors``, all over one anonymous mapping of their own
    (each 64-byte aligned): memory the runtime registers with the fabric as one region, whatever the C library's heap
    does."""
    import torch

    offsets, end = [], 0
    for _ in range(sets):
        for tensor in tensors:
            offsets.append(end)
            end += -(-tensor.numel() * tensor.element_size() // 64) * 64
    # private: a shared anonymous mapping is ``/dev/zero``'s, which the runtime does not register as an allocator's
    memory = np.frombuffer(mmap.mmap(-1, max(end, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                           dtype=np.uint8)
    made = [torch.from_numpy(memory[offset:offset + tensor.numel() * tensor.element_size()]
                             .view(_numpy_dtype(tensor.dtype)).reshape(tuple(tensor.shape)))
            for offset, tensor in zip(offsets, tensors * sets, strict=True)]
    return [made[i * len(tensors):(i + 1) * len(tensors)] for i in range(sets)]


def variables(model: Any) -> tuple[list[Any], list[Any]]:
    """A torch model's variables in the seam's order: its trainable parameters, and its buffers (the state)."""
    return [parameter for _, parameter in _trainable(model)], [buffer for _, buffer in _state(model)]


def _sparse_gradient(parameter: Any) -> bool:
    """Whether ``parameter``'s gradient will be sparse (an ``nn.Embedding(sparse=True)``'s weight)."""
    return bool(getattr(parameter, "_sparse_gradient", False))


def _trainable(model: Any) -> list[tuple[str, Any]]:
    """The trainable parameters, in ``named_parameters()`` order; an embedding with a sparse gradient marked."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Embedding | torch.nn.EmbeddingBag) and module.sparse:
            module.weight._sparse_gradient = True
    return [(path, parameter) for path, parameter in model.named_parameters() if parameter.requires_grad]


def _state(model: Any) -> list[tuple[str, Any]]:
    """The buffers the forward pass updates (BatchNorm's running statistics and batch count): the state."""
    return list(model.named_buffers())


def _out(tensor: Any) -> Any:
    """A dense tensor handed out over its own memory: a NumPy array on the host, a CuPy array on a GPU."""
    return tensor.numpy() if tensor.device.type == "cpu" else adopt(tensor)


def _device(memory: Memory) -> Any:
    import torch

    return torch.device("cuda", memory.device)


def _tensor(array: Any) -> Any:
    """A torch tensor over a NumPy array's memory (no copy)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(array))


def _numpy_dtype(dtype: Any) -> np.dtype:
    import torch

    return np.dtype(torch.empty((), dtype=dtype).numpy().dtype)
