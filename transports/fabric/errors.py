"""The fabric's errors: every backend raises these, and the transports above catch them by kind."""

from __future__ import annotations


class FabricError(RuntimeError):
    """A fabric operation failed; the message names the operation and the backend's reason."""


class FabricTimeout(FabricError):
    """A blocking fabric operation or wait did not finish in time."""


class FabricInterrupted(FabricError):
    """A blocking wait was cut short by :meth:`Device.interrupt_waits` (the owner is closing)."""
