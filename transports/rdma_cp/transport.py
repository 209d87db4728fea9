"""RDMA.cp: the zerocopy protocol with the graph analysis turned off.

Without the analysis, the sender cannot build tensors in registered memory:
``allocate()`` returns ordinary memory, and every send first copies the tensor
into a registered staging buffer (one copy on the sender, counted in the
ledger), then writes it as zerocopy does. Receive slots are still placed
statically, so the receiver copies nothing. The protocol is zerocopy's
(``transports/zerocopy/transport.py``); what is rdma_cp's own is its sending
policy, :class:`StageEverySend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from transports.zerocopy.transport import SendInPlace, ZeroCopyTransport

if TYPE_CHECKING:
    from transports.zerocopy.transport import _Outgoing


class StageEverySend(SendInPlace):
    """rdma_cp's sender: every tensor copied into its registered staging buffer first (one copy, counted);
    ``allocate()`` hands out ordinary memory, the analysis places the receives only."""

    places_sends = False
    analysis = "receives"

    def static_source(self, transport: ZeroCopyTransport, outgoing: _Outgoing, array: np.ndarray) -> np.ndarray:
        return transport._flat(outgoing, array)

    def source(self, transport: ZeroCopyTransport, outgoing: _Outgoing, flat: np.ndarray) -> np.ndarray:
        return transport._stage(outgoing, flat)


class RdmaCopyTransport(ZeroCopyTransport):
    """Zerocopy's protocol with a staging copy on every send (its sender: :class:`StageEverySend`)."""

    name = "rdma_cp"
    sender = StageEverySend()

    @classmethod
    def modes(cls) -> dict:
        return {}
