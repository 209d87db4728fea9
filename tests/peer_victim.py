"""The peer that tests/test_peer_kill.py kills: ``python -m tests.peer_victim SETUP_JSON``.

It starts one transport as rank ``rank`` of the given cluster and plays ``role``
(``sender``: rank 0 sends to rank 1; ``receiver``: the other way round) until
killed, saying on stdout how far it got, one line per stage:

- ``started``: the transport is up (phase ``setup`` stops here and sleeps);
- ``contact``: one tensor has gone through (phase ``poll`` then sleeps, so the
  survivor waits on a live, idle peer when the kill comes);
- phase ``transfer``: after ``contact`` it streams large tensors, step after
  step, so the kill lands in the middle of one.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import transports
from transports import Cluster, Key

#: the tensor of phase ``transfer``: large enough that a kill lands mid-transfer
STREAM_BYTES = 32 << 20


def say(stage: str) -> None:
    print(stage, flush=True)


def main(setup: dict) -> None:
    cluster = Cluster(tuple(setup["addresses"]), setup["token"])
    transport = transports.create(setup["transport"], timeout_s=setup["timeout_s"], **setup["options"])
    transport.start(cluster, setup["rank"])
    say("started")
    if setup["phase"] == "setup":
        time.sleep(3600)
    sending = setup["role"] == "sender"
    src, dst = 0, 1  # rank 0 sends, rank 1 receives
    if sending:
        transport.send(Key("contact", 0, src, dst), np.arange(16, dtype=np.float32))
    else:
        transport.recv(Key("contact", 0, src, dst))
    say("contact")
    if setup["phase"] == "poll":
        time.sleep(3600)
    payload = np.ones(STREAM_BYTES, dtype=np.uint8)
    for step in range(1 << 30):
        if sending:
            transport.send(Key("stream", step, src, dst), payload)
        else:
            transport.recv(Key("stream", step, src, dst))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
