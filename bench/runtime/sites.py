"""Allocation-site tracing (the paper's section 3.4, "decide tensor allocation site"), for one worker.

A tensor a worker sends is produced by its framework, in memory the framework's allocator chose: to send it
without a copy, that memory must be registered with the fabric, and registering per step is what the
paper avoids. In the first mini-batch, for every tensor sent, the tracer records its allocation site
(where the analyzer's plan says the framework allocates it) and where its buffer is; a buffer outside
registered memory has its allocator region registered with the transport, once
(``Placement.register_site``, of the transport's ``placement``). The transport counts, per send,
whether the tensor was in registered memory (``sends_registered``, a registration-cache hit) or not
(``sends_unregistered``); after every later step the tracer registers the regions of the tensors that
missed, so each region is registered once. With TensorFlow's BFC allocator (which the runtime selects) the regions are
reused every step: once the allocator has stopped growing (a step or two), every tensor hits. PyTorch's CPU
allocator takes memory from the C library's ``malloc``, which gives a large gradient pages of its own
each step; the record's registrations and hit rate say what that costs.

The paper redirects the allocation itself (a site in its set allocates from the RDMA allocator); from
Python a framework's allocator cannot be told where to put one operation's output, so the regions
it uses are registered instead. They are registered for this process's sends only: a tensor there
that a peer must read (dynamic allocation) is staged into the transport's pool, never exposed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.runtime.analyzer import Plan


class AllocationSites:
    """What one worker's first mini-batch showed about where its sent tensors were produced."""

    def __init__(self, transport, plan: Plan, rank: int) -> None:
        self.transport = transport
        self.plan = plan
        self.rank = rank
        #: allocation site -> tensors it produced (first step), and how many were in registered memory already
        self.sites: dict[str, int] = {}
        self.registered_already = 0
        self.regions = 0
        self.region_bytes = 0
        #: tensors whose region could not be registered, and why
        self.refused: dict[str, str] = {}
        #: tensors found outside registered memory after the first step: name -> steps
        self.missed: dict[str, int] = {}
        #: the transport's count of sends from unregistered memory when last looked at (the runtime traces a step
        #: only when it grew, so a step where every tensor hit costs no lookups)
        self.misses_seen = 0

    def trace(self, updates: list[list[tuple[str, np.ndarray]]], first: bool) -> None:
        """A step's tensors, once sent (per variable, ``(name, array)``): register the allocator regions of those
        outside registered memory, so that the next steps find them there. The first step also records each
        tensor's site; later ones note which tensors missed (the transport counted them when it sent them)."""
        layout = self.plan.layout
        for variable, parts in zip(self.plan.variables, updates, strict=True):
            for name, array in parts:
                if first:
                    site = self.plan.transfer(name, self.rank, layout.ps_of(variable)).site
                    self.sites[site] = self.sites.get(site, 0) + 1
                if self.transport.placement.registered(array):
                    self.registered_already += first
                    continue
                if not first:
                    self.missed[name] = self.missed.get(name, 0) + 1
                try:
                    registered = self.transport.placement.register_site(array)
                except ValueError as exc:
                    self.refused[name] = str(exc)
                    continue
                if registered:
                    self.regions += 1
                    self.region_bytes += registered

    def summary(self) -> dict[str, Any]:
        return {"sites": len(self.sites), "registered_already": self.registered_already, "regions": self.regions,
                "region_bytes": self.region_bytes, "refused": dict(list(self.refused.items())[:5]),
                "missed": dict(sorted(self.missed.items(), key=lambda item: -item[1])[:5])}
