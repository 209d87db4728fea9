"""Model builders for the tf_grpc tests that fail or hang, importable by name in the chief's process."""

from __future__ import annotations

import time


def build_failing():
    raise RuntimeError("no model today: build_failing was asked to fail")


def build_hanging():
    time.sleep(3600)
