"""Builds the UCX binding (cffi, API mode) at install time; everything else is in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["transports/fabric/ucx/build.py:ffibuilder"])
