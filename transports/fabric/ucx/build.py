"""Builds the cffi binding (API mode) of the UCP calls the ``ucx`` fabric uses.

Run at install time by ``setup.py``; a user never compiles by hand. Headers and
libraries come from the PyPI wheel ``libucx-cu12`` (no GPU needed; the linker is
given its ``lib/``, so nothing of the system's is needed), or from the UCX
installed under ``$TENSOR_BENCH_UCX_HOME`` when that is set (say, a cluster's
UCX built with verbs, for real RDMA with the same code).

A small C shim (``shim.c`` beside this file) hides UCX's parameter structs and
unions: Python sees plain functions, declared for cffi in ``shim_cdef.h``.
Completion is observed by polling request status, never by calling back into
Python from UCX. The shim is compiled with the warnings of ``WARNINGS``; with
``TENSOR_BENCH_WERROR=1`` (CI) a warning fails the build.
"""

from __future__ import annotations

import os
from pathlib import Path

from cffi import FFI

UCX_HOME_VARIABLE = "TENSOR_BENCH_UCX_HOME"  # the same name as device.UCX_HOME_VARIABLE

#: the shim (C, included by the source cffi generates) and what Python sees of it (cffi's cdef), beside this file
HERE = Path(__file__).resolve().parent
SHIM_SOURCE, SHIM_CDEF = HERE / "shim.c", HERE / "shim_cdef.h"

#: when it is 1 (CI sets it), any compiler warning fails the build; else warnings are only shown (``pip install -v``)
WERROR_VARIABLE = "TENSOR_BENCH_WERROR"
#: the warnings the shim is compiled with; UCX's own headers are included as system headers, so only ours count
WARNINGS = ["-Wall", "-Wextra", "-Wshadow", "-Wstrict-prototypes", "-Wpointer-arith", "-Wformat=2", "-Wundef",
            "-Wvla", "-Wwrite-strings"]
#: the compiler's own include directories: given as -I (it keeps them system ones), never as -isystem
_DEFAULT_INCLUDES = (Path("/usr/include"), Path("/usr/local/include"))


#: the binding of the libucx-cu12 wheel (always built) and of a system UCX (built when UCX_HOME_VARIABLE is set)
WHEEL_MODULE, SYSTEM_MODULE = "transports.fabric.ucx._ucp", "transports.fabric.ucx._ucp_system"


def system_home() -> Path | None:
    """The system UCX install ``$TENSOR_BENCH_UCX_HOME`` names, or None (the wheel only)."""
    value = os.environ.get(UCX_HOME_VARIABLE)
    return Path(value) if value else None


def library_dir(home: Path) -> Path:
    """Where ``libucp.so`` of the UCX under ``home`` is: ``lib/``, ``lib64/`` or Debian's ``lib/<multiarch>/``."""
    candidates = [home / "lib", home / "lib64", *sorted((home / "lib").glob("*-linux-gnu*"))]
    for candidate in candidates:
        if any(candidate.glob("libucp.so*")):
            return candidate
    raise FileNotFoundError(f"{UCX_HOME_VARIABLE}={home}: no libucp.so under {', '.join(map(str, candidates))} "
                            f"(on Debian: apt install libucx-dev, then {UCX_HOME_VARIABLE}=/usr)")


def wheel_home() -> Path:
    """The libucx-cu12 wheel's install (``include/``, ``lib/``) in the environment that builds the binding."""
    import libucx  # the PyPI wheel libucx-cu12

    return Path(libucx.__file__).parent


#: the wheel's ``lib/`` seen from the binding where a wheel of this project puts both in one site-packages
#: (``transports/fabric/ucx/`` beside ``libucx/``)
WHEEL_RPATH = "$ORIGIN/../../../libucx/lib"


def run_paths(home: Path | None, lib: Path) -> list[str]:
    """Where the loader looks for UCX at run time (the binding's rpath).

    A system UCX stays where it was built against. The wheel's build directory is pip's temporary build
    environment, gone after the install, so it is never named: a regular install finds the wheel beside the
    package (``WHEEL_RPATH``), and in every install ``device.load()`` has ``libucx.load_library()`` load the
    wheel's libraries by their full paths before importing the binding, which then needs no search path.
    """
    return [str(lib)] if home is not None else [WHEEL_RPATH]


def compile_args() -> list[str]:
    """The compiler's warning options: ``WARNINGS``, and ``-Werror`` when ``$TENSOR_BENCH_WERROR`` is 1."""
    return WARNINGS + (["-Werror"] if os.environ.get(WERROR_VARIABLE) == "1" else [])


def make_ffibuilder(home: Path | None = None) -> FFI:
    """The binding of the UCX under ``home`` (a system install), or of the libucx-cu12 wheel when None."""
    if home is None:
        include, lib, module, origin = wheel_home() / "include", wheel_home() / "lib", WHEEL_MODULE, "libucx-cu12"
    else:
        if not (home / "include" / "ucp" / "api" / "ucp.h").is_file():
            raise FileNotFoundError(f"{UCX_HOME_VARIABLE}={home}: no include/ucp/api/ucp.h there (the UCX headers; "
                                    f"on Debian: apt install libucx-dev)")
        include, lib, module, origin = home / "include", library_dir(home), SYSTEM_MODULE, str(home)
    ffibuilder = FFI()
    ffibuilder.cdef(SHIM_CDEF.read_text())
    quoted = origin.replace("\\", "\\\\").replace('"', '\\"')
    system_header = include in _DEFAULT_INCLUDES
    ffibuilder.set_source(
        module,
        f'#define TT_BUILT_AGAINST "{quoted}"\n#include "{SHIM_SOURCE.name}"\n',
        include_dirs=[str(HERE)] + ([str(include)] if system_header else []),
        library_dirs=[str(lib)],
        libraries=["ucp", "uct", "ucs", "dl"],  # (dl: the shim opens the CUDA driver itself, where UCX uses it)
        # warnings in UCX's headers are not ours to fix: they are included as system headers
        extra_compile_args=compile_args() + ([] if system_header else ["-isystem", str(include)]),
        extra_link_args=[f"-Wl,-rpath,{rpath}" for rpath in run_paths(home, lib)],
        # the generated C file only includes the shim: a changed shim must still be recompiled
        depends=[str(SHIM_SOURCE), str(SHIM_CDEF)],
    )
    return ffibuilder


ffibuilder = make_ffibuilder()
#: built too when TENSOR_BENCH_UCX_HOME is set at install time (setup.py); used when it is set at run time
system_ffibuilder = make_ffibuilder(system_home()) if system_home() else None

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
    if system_ffibuilder is not None:
        system_ffibuilder.compile(verbose=True)
