"""Builds the UCX binding (cffi, API mode) at install time; everything else is in pyproject.toml.

The binding of the libucx-cu12 wheel is always built; with ``TENSOR_BENCH_UCX_HOME`` set (a system UCX,
for example one with verbs: ``TENSOR_BENCH_UCX_HOME=/usr`` with Debian's libucx-dev) a second one is
built against that UCX, and the fabric uses it whenever the variable is set at run time.
"""

import os

from setuptools import setup

BUILD = "transports/fabric/ucx/build.py"
modules = [f"{BUILD}:ffibuilder"]
if os.environ.get("TENSOR_BENCH_UCX_HOME"):
    modules.append(f"{BUILD}:system_ffibuilder")

setup(cffi_modules=modules)
