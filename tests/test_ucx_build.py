"""The ucx fabric's C shim: real files that the cffi build compiles, with warnings on, and that a package ships."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from transports.fabric.ucx import build

ROOT = Path(__file__).resolve().parent.parent
UCX_DIR = ROOT / "transports" / "fabric" / "ucx"


def test_the_shim_is_c_files_beside_the_build_and_no_c_is_left_in_python():
    assert build.SHIM_SOURCE == UCX_DIR / "shim.c" and build.SHIM_CDEF == UCX_DIR / "shim_cdef.h"
    assert build.SHIM_SOURCE.is_file() and build.SHIM_CDEF.is_file()
    assert "#include <" not in (UCX_DIR / "build.py").read_text()


def test_the_generated_module_compiles_the_shim_file(tmp_path):
    extension = build.make_ffibuilder().distutils_extension(str(tmp_path))
    generated = Path(extension.sources[0]).read_text()
    assert '#include "shim.c"' in generated and '#define TT_BUILT_AGAINST "libucx-cu12"' in generated
    assert str(UCX_DIR) in extension.include_dirs
    # the generated file does not change with the shim: the build must still see the shim as an input
    assert {str(build.SHIM_SOURCE), str(build.SHIM_CDEF)} <= set(extension.depends)
    assert set(build.WARNINGS) <= set(extension.extra_compile_args) and "-Wextra" in build.WARNINGS


def test_warnings_fail_the_build_only_when_asked(monkeypatch):
    monkeypatch.delenv(build.WERROR_VARIABLE, raising=False)
    assert "-Werror" not in build.compile_args()
    monkeypatch.setenv(build.WERROR_VARIABLE, "1")
    assert build.compile_args()[-1] == "-Werror"


def test_the_cdef_is_plain_declarations_and_each_shim_function_is_defined():
    cdef = build.SHIM_CDEF.read_text()
    directives = [line for line in cdef.splitlines() if line.lstrip().startswith("#")]
    assert directives and all(re.fullmatch(r"#define [A-Z_]+ \.\.\.", line) for line in directives), directives
    source = build.SHIM_SOURCE.read_text()
    declared = set(re.findall(r"\b(tt_\w+)\(", re.sub(r"/\*.*?\*/", "", cdef, flags=re.S)))
    defined = set(re.findall(r"^static [^;{]*?\b(tt_\w+)\(", source, flags=re.M))
    assert declared and declared <= defined, declared - defined


def test_a_package_ships_the_shim_files():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert {"fabric/ucx/shim.c", "fabric/ucx/shim_cdef.h"} <= set(package_data["transports"])


def test_the_wheel_binding_links_against_the_wheel_and_finds_it_beside_the_package(tmp_path):
    """A machine with no system UCX links: the linker is given the wheel's lib/, never left to the system's."""
    extension = build.make_ffibuilder().distutils_extension(str(tmp_path))
    wheel_lib = build.wheel_home() / "lib"
    assert any(wheel_lib.glob("libucp.so*"))
    assert extension.library_dirs == [str(wheel_lib)]
    assert {"ucp", "uct", "ucs"} <= set(extension.libraries)
    # pip's build environment (where wheel_lib is) is gone after the install: the run path never names it
    assert extension.extra_link_args == [f"-Wl,-rpath,{build.WHEEL_RPATH}"]


def test_a_system_ucx_binding_links_against_that_ucx_and_keeps_its_path(tmp_path):
    home = tmp_path / "ucx"
    (home / "include" / "ucp" / "api").mkdir(parents=True)
    (home / "include" / "ucp" / "api" / "ucp.h").write_text("")
    (home / "lib64").mkdir()
    (home / "lib64" / "libucp.so").write_text("")
    extension = build.make_ffibuilder(home).distutils_extension(str(tmp_path / "out"))
    assert extension.library_dirs == [str(home / "lib64")]
    assert extension.extra_link_args == [f"-Wl,-rpath,{home / 'lib64'}"]
    assert extension.name == build.SYSTEM_MODULE
