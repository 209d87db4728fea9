"""RDMA.cp: the zerocopy protocol with the graph analysis turned off.

Without the analysis, the sender cannot build tensors in registered memory:
``allocate()`` returns ordinary memory, and every send first copies the tensor
into a registered staging buffer (one copy on the sender, counted in the
ledger), then writes it as zerocopy does. Receive slots are still placed
statically, so the receiver copies nothing.
"""

from __future__ import annotations

from transports.zerocopy.transport import StageEverySend, ZeroCopyTransport


class RdmaCopyTransport(ZeroCopyTransport):
    """Zerocopy's protocol with a staging copy on every send (its sender: :class:`StageEverySend`)."""

    name = "rdma_cp"
    sender = StageEverySend()

    @classmethod
    def modes(cls) -> dict:
        return {}
