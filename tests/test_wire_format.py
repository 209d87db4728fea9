"""The run's wire format (bench/launch/wire.py): data only, never a pickle. What the project sends comes back equal;
a frame that names code, claims memory it does not hold, nests too deep or is any bytes at all is a value or one
line (WireError), never a traceback, a signal, or memory beyond a bound."""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import json
import os
import struct
import subprocess
import sys
from pathlib import Path, PurePosixPath

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.launch import wire
from bench.launch.messages import Assignment, Finished, Hello, RankSpec, Relay, Report
from bench.launch.wire import FORMAT, WireError, decode_message, encode_message, wire_value
from tests import launch_jobs as jobs

ROOT = Path(__file__).resolve().parent.parent
#: what a hostile frame under 1 MB may make the decoder allocate, at most (the issue's bound)
HOSTILE_PEAK = 10 << 20

# -- frames by hand: what a peer could send, whatever the encoder would refuse -----------------------------------------


def text(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("<I", len(raw)) + raw


def frame(*parts: bytes) -> bytes:
    return bytes((FORMAT,)) + b"".join(parts)


def ref(name: str) -> bytes:
    return wire.REF + text(name)


def string(value: str) -> bytes:
    return wire.STR + text(value)


def items(tag: bytes, *values: bytes) -> bytes:
    return tag + struct.pack("<I", len(values)) + b"".join(values)


def partial(func: bytes, *args: bytes) -> bytes:
    return wire.PARTIAL + func + items(wire.TUPLE, *args) + items(wire.DICT)


def instance(cls: str, **fields: bytes) -> bytes:
    return wire.OBJECT + text(cls) + struct.pack("<I", len(fields)) + b"".join(
        text(name) + value for name, value in fields.items())


def array(dtype: str, shape: tuple[int, ...], raw: bytes) -> bytes:
    return wire.ARRAY + text(dtype) + bytes((len(shape),)) + struct.pack(f"<{len(shape)}q", *shape) + raw


def assert_value_or_one_line(data: bytes) -> object:
    try:
        return decode_message(data)
    except WireError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("refus"), str(exc)
        return exc


_PEAKS_IN_A_FRESH_INTERPRETER = """
import json, sys, tracemalloc
from pathlib import Path
from bench.launch.wire import WireError, decode_message
import tests.test_wire_format  # the classes the frames name, imported before the count as in a run
peaks = {}
for path in sorted(Path(sys.argv[1]).iterdir()):
    data = path.read_bytes()
    tracemalloc.start()
    try:
        decode_message(data)
        error = None
    except WireError as exc:
        error = str(exc)
    peaks[path.name] = [tracemalloc.get_traced_memory()[1], error]
    tracemalloc.stop()
print(json.dumps(peaks))
"""


def peaks_of(frames: dict[str, bytes], folder: Path) -> dict[str, tuple[int, str | None]]:
    """The most decoding each frame allocated, and its WireError's text (None for a value), measured in an
    interpreter of its own: tracemalloc counts every thread of a process, and a test process has threads that
    earlier tests left running (a gRPC poller, a progress thread) whose allocations are not the decoder's."""
    for number, data in enumerate(frames.values()):
        (folder / f"{number:03d}").write_bytes(data)
    done = subprocess.run([sys.executable, "-c", _PEAKS_IN_A_FRESH_INTERPRETER, str(folder)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=True)
    measured = json.loads(done.stdout)
    return {name: tuple(measured[f"{number:03d}"]) for number, name in enumerate(frames)}


# -- what travels ---------------------------------------------------------------------------------------------------


class Colour(enum.Enum):
    RED = "red"
    BLUE = 2


class Level(enum.IntEnum):
    LOW = 1


@dataclasses.dataclass(frozen=True)
class Guarded:
    """A frozen dataclass whose __post_init__ and __setattr__ must not run on the receiving side."""

    name: str
    sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.name == "bad":
            raise AssertionError("__post_init__ ran on load")


@dataclasses.dataclass(frozen=True, slots=True)
class Slotted:
    a: int
    b: object = None


class Plain:
    """A plain class with private state (like bench.ground.stats.StreamingStats)."""

    def __init__(self) -> None:
        raise AssertionError("__init__ ran on load")

    def total(self) -> int:
        return int(self._counts.sum())


class Touchy:
    """A class whose attributes have code behind them: nothing of it runs on load."""

    __slots__ = ("value",)

    def __setattr__(self, name, value):
        raise AssertionError("__setattr__ ran on load")


class Stated:
    def __setstate__(self, state):
        raise AssertionError("__setstate__ ran on load")


def job(ctx):  # a rank job: it takes ctx
    return ctx


def helper(path):  # not a job, not marked
    return path


@wire_value
def marked(x):
    return x + 1


def _plain_with(counts: np.ndarray) -> Plain:
    obj = object.__new__(Plain)
    obj._counts = counts
    return obj


def _messages() -> list[object]:
    from transports import Cluster

    spec = RankSpec(functools.partial(jobs.fail, wait_for_go=True), "ps 0", host=1)
    return [
        None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**64, -(10**40), 1.5, float("inf"), 2j, "", "héllo \ud800",
        b"", b"\0" * 10, bytearray(b"ab"), [], (), {}, set(), frozenset(), [1, [2, (3, {4: "x"})]],
        {(1, "a"): 2.0, None: [1], 3: {"nested": (1, 2)}, frozenset({1}): b"x"}, {1, "two", (3,)},
        collections.OrderedDict([("b", 1), ("a", 2)]), Path("/tmp/x"), PurePosixPath("rel/x"),
        Colour.RED, Colour.BLUE, Level.LOW, {Colour.RED: Level.LOW},
        np.float32(1.5), np.int64(-3), np.bool_(True), np.float64(2.5), np.datetime64("2024-01-02", "ns"),
        np.dtype("<f4"), np.dtype(">i2"), np.dtype("U3"),
        np.arange(6.0).reshape(2, 3)[:, 1], np.zeros((0, 3), np.int16), np.array(5, np.uint8),
        np.array([True, False]), np.array(["ab", "c"]), np.asfortranarray(np.arange(6).reshape(2, 3)),
        np.arange(4, dtype=">u4"), np.array(["2024-01-01"], "datetime64[s]"),
        Hello(3), Report(("step", 1, 0.5)), Relay(0, 1, {"go": True}), Finished([{"bytes": 1024, "us": 3.5}], 12.0),
        spec, Assignment(2, spec, Cluster(("127.0.0.1:5000", "127.0.0.1:5001"), "token"), "veth0"),
        Guarded("ok", (1, 2)), Slotted(1, Slotted(2)), job, marked, jobs.hello, Guarded, Colour,
        functools.partial(marked, 1), functools.partial(job, key=Path("/")),
    ]


def _same(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b) and b.flags.writeable
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, set | frozenset):
        return a == b
    if isinstance(a, functools.partial):
        return a.func is b.func and _same(a.args, b.args) and _same(a.keywords, b.keywords)
    if isinstance(a, float) and a != a:
        return b != b
    return a == b and repr(a) == repr(b)


@pytest.mark.parametrize("message", _messages(), ids=lambda m: type(m).__name__)
def test_what_the_project_sends_comes_back_equal(message):
    assert _same(decode_message(encode_message(message)), message)


def test_instances_are_made_without_running_their_code():
    bad = Guarded("ok")
    object.__setattr__(bad, "name", "bad")
    back = decode_message(encode_message([bad, _plain_with(np.ones(3))]))
    assert back[0].name == "bad" and back[1].total() == 3  # no __post_init__, no __init__, the array writable
    back[1]._counts += 1
    touchy = object.__new__(Touchy)
    object.__setattr__(touchy, "value", [1])
    assert decode_message(encode_message(touchy)).value == [1]


def test_methods_travel_bound_and_only_public_ones_of_data_classes():
    total = decode_message(encode_message(_plain_with(np.ones(2)).total))
    assert total() == 2
    for method in (Slotted(1).__repr__, [].append, "x".format):
        with pytest.raises(WireError, match=r"^cannot send|^refusing"):
            encode_message(method)


@pytest.mark.parametrize("value, fragment", [
    (lambda: None, "refusing tests.test_wire_format.<lambda>"),
    (helper, "refusing tests.test_wire_format.helper"),
    (ValueError("x"), "refusing builtins.ValueError"),
    (Stated(), "refusing tests.test_wire_format.Stated"),
    (np.array([1, "x"], dtype=object), "holds Python objects"),
    (np.zeros(2, "f4,i4"), "structured dtype"),
    (os.system, "refusing posix.system"),
    (collections.defaultdict(list), "refusing collections.defaultdict"),
])
def test_what_cannot_travel_is_refused_where_it_is_sent(value, fragment):
    with pytest.raises(WireError) as refused:
        encode_message(value)
    assert fragment in str(refused.value) and "\n" not in str(refused.value)


def test_a_value_that_holds_itself_or_nests_too_deep_is_refused_where_it_is_sent():
    loop: list = []
    loop.append(loop)
    deep: list = []
    for _ in range(wire.MAX_DEPTH + 1):
        deep = [deep]
    for value in (loop, deep):
        with pytest.raises(WireError, match="nested deeper than"):
            encode_message(value)
    ok: list = []
    for _ in range(wire.MAX_DEPTH - 1):
        ok = [ok]
    assert decode_message(encode_message(ok)) == ok


def test_a_user_module_travels_once_named_in_the_variable(tmp_path, monkeypatch):
    (tmp_path / "my_workload.py").write_text(
        "import dataclasses\n@dataclasses.dataclass\nclass Mine:\n    n: int = 1\n    def build(self):\n"
        "        return self.n\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_workload

    with pytest.raises(WireError, match=r"refusing my_workload\.Mine"):
        encode_message(my_workload.Mine())
    monkeypatch.setenv(wire.WIRE_MODULES_VARIABLE, "my_workload")
    assert decode_message(encode_message(my_workload.Mine(5).build))() == 5


# -- what a stranger sends ------------------------------------------------------------------------------------------


def _hostile() -> list[bytes]:
    touch = string("touch /tmp/wire-pwned")
    return [
        frame(ref("posix:system")),
        frame(partial(ref("posix:system"), touch)),
        frame(partial(ref("builtins:eval"), string("1"))),
        frame(partial(ref("subprocess:Popen"), items(wire.LIST, touch))),
        frame(instance("bench.launch.messages:Report", payload=partial(ref("os:system"), touch))),
        frame(instance("numpy:dtype")),  # the class whose __setstate__ crashed numpy
        frame(instance("bench.launch.messages:LaunchError")),  # an exception: not data
        frame(instance("tests.test_wire_format:Stated")),  # its own __setstate__
        frame(instance("tests.test_wire_format:Guarded", __class__=ref("tests.test_wire_format:Stated"))),
        frame(instance("tests.test_wire_format:Touchy", other=string("x"))),  # no such slot, no __dict__
        frame(instance("tests.test_wire_format:Colour")),  # an enum is sent by member only
        frame(wire.ENUM + text("tests.test_wire_format:Colour") + text("_missing_")),
        frame(wire.ENUM + text("tests.test_wire_format:Guarded") + text("x")),
        frame(instance("bench.launch.messages:RankSpec", name=string("x"), job=partial(
            ref("bench.results.files:replace_file"), string("/tmp/wire-pwned"), wire.BYTES + text("x")))),
        frame(wire.METHOD + wire.PATH + text("PosixPath") + text("/tmp/wire-pwned") + text("unlink")),
        frame(wire.METHOD + instance("tests.test_wire_format:Guarded", name=string("x")) + text("__class__")),
        frame(wire.METHOD + instance("tests.test_wire_format:Guarded", name=string("x")) + text("name")),
        frame(wire.METHOD + ref("tests.test_wire_format:Guarded") + text("__init__")),
        frame(wire.METHOD + string("x") + text("format")),
        frame(ref("tests.test_wire_format:helper")),
        frame(ref("bench.launch.wire:os.system")),
        frame(ref("bench.launch.wire:__builtins__.eval")),
        frame(ref("no colon")),
        frame(wire.PATH + text("WindowsPath") + text("C:\\")),
        frame(array("|O", (1,), b"\0" * 8)),
        frame(array("f4,i4", (1,), b"\0" * 8)),
        frame(wire.DTYPE + text("O")),
        frame(wire.SCALAR + text("V0")),
        b"\x80\x02cnumpy\ndtype\nq\x00X\x02\x00\x00\x00f8q\x01\x89\x88\x87q\x02Rq\x03(K\x03X\x01\x00\x00\x00<q\x04N"
        b"J\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tq\x05b.",  # the old wire's crash: dtype.__setstate__ by BUILD
        b"cos\nsystem\n(S'true'\ntR.",
    ]


def test_a_frame_that_names_code_is_one_line_and_makes_nothing():
    for data in _hostile():
        with pytest.raises(WireError) as refused:
            decode_message(data)
        assert "\n" not in str(refused.value) and str(refused.value).startswith("refus"), str(refused.value)
    assert not Path("/tmp/wire-pwned").exists()
    with pytest.raises(WireError, match=r"^refusing posix\.system on the run's channels"):
        decode_message(frame(partial(ref("posix:system"), string("true"))))
    with pytest.raises(WireError, match="a pickle"):
        decode_message(b"\x80\x05N.")


def test_the_numpy_dtype_state_that_crashed_the_coordinator_is_refused_in_a_process_that_lives():
    """The old wire admitted numpy.dtype and BUILD: ``dtype.__setstate__((3, '<', None, -1, -1, 0))`` killed the
    decoding process with SIGSEGV. Decoded in a process of its own, so that a signal fails the test, not the run."""
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from bench.launch.wire import decode_message, WireError\n"
              "from tests.test_wire_format import _hostile\n"
              "for data in _hostile():\n"
              "    try:\n        decode_message(data)\n    except WireError:\n        pass\n"
              "print('alive')\n")
    done = subprocess.run([sys.executable, "-c", script, str(ROOT)], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout.strip()) == (0, "alive"), done.stderr[-2000:]


#: frames of under 1 MB that claim, or make, as much as they can
def _greedy() -> dict[str, bytes]:
    most = (1 << 32) - 1
    n = 1 << 20
    nested = b"".join(wire.LIST + struct.pack("<I", 1 << 14) for _ in range(60)) + wire.NONE * (1 << 14)
    return {
        "bytes claiming 4 GiB": frame(wire.BYTES + struct.pack("<I", most) + b"abc"),
        "bytearray claiming 4 GiB": frame(wire.BYTEARRAY + struct.pack("<I", most)),
        "str claiming 4 GiB": frame(wire.STR + struct.pack("<I", most) + b"x"),
        "list claiming 4 G items": frame(wire.LIST + struct.pack("<I", most)),
        "dict claiming 4 G items": frame(wire.DICT + struct.pack("<I", most)),
        "big int claiming 4 GiB": frame(wire.BIG_INT + struct.pack("<I", most)),
        "array claiming 2**62 bytes": frame(array("<f8", (1 << 30, 1 << 29), b"")),
        "array claiming a dimension of 2**63-1": frame(array("<f8", (2**63 - 1,), b"")),
        "array of 64 dims claiming 2**64 each": frame(wire.ARRAY + text("<f8") + bytes((64,)) + b"\xff" * 512),
        "nested lists each claiming 16 k": frame(nested),
        "list of a million Nones": frame(wire.LIST + struct.pack("<I", n - 16) + wire.NONE * (n - 16)),
        "tuple of a million Nones": frame(wire.TUPLE + struct.pack("<I", n - 16) + wire.NONE * (n - 16)),
        "empty sets": frame(items(wire.LIST, *[items(wire.SET)] * ((n - 16) // 5))),
        "empty dicts": frame(items(wire.LIST, *[items(wire.ORDERED_DICT)] * ((n - 16) // 5))),
        "a dict of int keys": frame(items(wire.DICT, *[wire.INT + struct.pack("<q", i) + wire.NONE
                                                         for i in range((n - 16) // 10)])),
        "a set of floats": frame(items(wire.SET, *[wire.FLOAT + struct.pack("<d", i) for i in range((n - 16) // 9)])),
        "a dict of text keys": frame(items(wire.DICT, *[string(f"{i:05x}") + wire.NONE for i in range(n // 12)])),
        "a list of text": frame(items(wire.LIST, *[string(f"{i:x}") for i in range(n // 10)])),
        "instances": frame(items(wire.LIST, *[instance("tests.test_wire_format:Guarded")] * (n // 40))),
        "deep nesting": frame(wire.LIST + struct.pack("<I", 1)) * 1 + (wire.LIST + struct.pack("<I", 1)) * 100_000,
        "bytes claiming more than the frame": frame(wire.BYTES + struct.pack("<I", n) + b"\0" * (n - 100)),
        "the old wire's BYTEARRAY8 of 256 MiB": b"\x80\x05\x96" + struct.pack("<Q", 1 << 28) + b"abc.",
    }


@pytest.fixture(scope="module")
def greedy_peaks(tmp_path_factory) -> dict[str, tuple[int, str | None]]:
    return peaks_of(_greedy(), tmp_path_factory.mktemp("greedy"))


@pytest.mark.parametrize("name", list(_greedy()))
def test_a_frame_under_1_mb_never_makes_the_decoder_allocate_10_mb(name, greedy_peaks):
    assert len(_greedy()[name]) < 1 << 20
    peak, error = greedy_peaks[name]
    assert error is None or ("\n" not in error and error.startswith("refus")), error
    assert peak < HOSTILE_PEAK, (name, peak)


def test_a_claim_beyond_the_frame_is_refused_naming_it():
    with pytest.raises(WireError, match=r"claims 4294967295 bytes at byte 6, where the frame has 3 left"):
        decode_message(frame(wire.BYTES + struct.pack("<I", (1 << 32) - 1) + b"abc"))
    with pytest.raises(WireError, match=r"array of \(1073741824, 536870912\) <f8 needs"):
        decode_message(frame(array("<f8", (1 << 30, 1 << 29), b"")))


def test_bools_arrive_as_bools_whatever_byte_was_sent():
    back = decode_message(frame(array("|b1", (3,), b"\x00\x02\xff")))
    assert back.tolist() == [False, True, True] and back.view(np.uint8).tolist() == [0, 1, 1]


def test_bfloat16_arrays_scalars_and_dtypes_come_back_as_bfloat16():
    """A bfloat16's ``dtype.str`` is an anonymous ``'<V2'``: sent so, it came back as raw records, not numbers."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    values = np.array([[1.5, -2.0, 3.25]], bf16)
    back = decode_message(encode_message(Report({"values": values, "one": values[0, 0], "dtype": bf16})))
    assert back.payload["values"].dtype == bf16 and back.payload["values"].shape == (1, 3)
    assert back.payload["values"].astype(np.float32).tolist() == [[1.5, -2.0, 3.25]]
    assert back.payload["values"].flags.writeable
    assert type(back.payload["one"]) is ml_dtypes.bfloat16 and float(back.payload["one"]) == 1.5
    assert back.payload["dtype"] == bf16


# -- any bytes, any shapes ------------------------------------------------------------------------------------------

_TAGS = [bytes((t,)) for t in wire._READERS] + [b"\x00", b"\xff"]
_pieces = st.one_of(
    st.sampled_from(_TAGS),
    st.builds(struct.pack, st.just("<I"), st.integers(0, (1 << 32) - 1)),
    st.builds(struct.pack, st.just("<q"), st.integers(-(2**63), 2**63 - 1)),
    st.sampled_from([text(s) for s in ("<f8", "|b1", "<U2", "|O", "f4,i4", "bench.launch.messages:Hello",
                                       "tests.test_wire_format:Guarded", "numpy:dtype", "posix:system", "rank",
                                       "tests.test_wire_format:Colour", "RED", "PosixPath", "build", "name",
                                       "bfloat16")]),
    st.binary(max_size=64),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096) | st.lists(_pieces, max_size=40).map(lambda parts: frame(*parts)))
def test_any_frame_is_a_value_or_one_line(data):
    assert_value_or_one_line(data)


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
    | st.binary(max_size=20) | st.sampled_from([Colour.RED, Level.LOW, Path("/x"), np.float32(2.5), np.int8(-1)])
    | st.builds(lambda dt, shape: (np.arange(int(np.prod(shape))) % 3).astype(dt).reshape(shape),
                st.sampled_from(["<f4", ">i8", "|u1", "<c16", "|b1", "<m8[s]"]),
                st.lists(st.integers(0, 4), max_size=4).map(tuple)),
    lambda inner: st.lists(inner, max_size=6) | st.lists(inner, max_size=6).map(tuple)
    | st.dictionaries(st.integers() | st.text(max_size=8), inner, max_size=6)
    | st.builds(Guarded, st.text(max_size=8).filter(lambda s: s != "bad"),
                st.lists(st.integers(), max_size=4).map(tuple))
    | st.builds(Slotted, st.integers(), inner) | st.builds(Relay, st.integers(), st.integers(), inner),
    max_leaves=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_values, st.data())
def test_any_value_comes_back_equal_and_any_change_to_its_frame_is_a_value_or_one_line(value, data):
    encoded = encode_message(value)
    assert _same(decode_message(encoded), value)
    at = data.draw(st.integers(0, len(encoded)))
    cut = data.draw(st.sampled_from(["flip", "truncate", "insert"]))
    if cut == "flip" and at < len(encoded):
        changed = encoded[:at] + bytes((encoded[at] ^ data.draw(st.integers(1, 255)),)) + encoded[at + 1:]
    elif cut == "insert":
        changed = encoded[:at] + data.draw(st.binary(min_size=1, max_size=8)) + encoded[at:]
    else:
        changed = encoded[:at]
    assert_value_or_one_line(changed)
