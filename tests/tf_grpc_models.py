"""Model builders for the tf_grpc tests that fail or hang, importable by name in the chief's process."""

from __future__ import annotations

import time

from bench.launch.wire import wire_value


@wire_value
def build_failing():
    raise RuntimeError("no model today: build_failing was asked to fail")


@wire_value
def build_hanging():
    time.sleep(3600)
