"""``bench compare``: ratios with their ranges, verdicts, exit statuses and one-line errors, on small runs."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from bench.commands import compare as command
from bench.readers.compare import FASTER, NOT_CALLED, SAME, SLOWER, CompareError, compare, parse_threshold
from bench.results import MicroRecord, RunWriter

SIZES = (1024, 65536)
TIMES = {"grpc_tcp": 100.0, "zerocopy": 20.0}


def micro(transport: str, size: int, p50_us: float | None, round: int = 1, **extra) -> MicroRecord:
    return MicroRecord(transport=transport, size_bytes=size, round=round, iters=10, p50_us=p50_us, p99_us=p50_us,
                       mean_us=p50_us, throughput_MBps=size / 2**20 / (p50_us / 1e6) if p50_us else None,
                       sender_cpu_s=0.1, receiver_cpu_s=0.1, copied_bytes_per_transfer=0.0, **extra)


def micro_run(path, factors=None, times=TIMES, sizes=SIZES, rounds=(1.0, 1.0, 1.0), references=(),
              **extra_by_transport):
    """A micro run: each transport's time at each size times its factor, one round per entry of ``rounds``
    (each round's times scaled by it; three by default, the fewest that call a change); ``references`` adds
    memcpy-like lines that scale with ``factors`` too."""
    factors = factors or {}
    writer = RunWriter(path, "micro", {})
    for number, scale in enumerate(rounds, start=1):
        for size in sizes:
            for transport, time in {**times, **dict.fromkeys(references, 5.0)}.items():
                value = time * (size / sizes[0]) ** 0.5 * factors.get(transport, 1.0) * scale
                writer.add(micro(transport, size, value, round=number, **extra_by_transport.get(transport, {})))
    writer.finish()
    return path


def run_command(capsys, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="bench compare")
    command.add_arguments(parser)
    status = command.run(parser.parse_args([str(a) for a in argv]))
    out, err = capsys.readouterr()
    return status, out, err


def states(comparison) -> dict[tuple, str]:
    return {row.point: row.state for row in comparison.rows}


def test_a_run_against_itself_is_the_same_everywhere_and_exits_0(tmp_path, capsys):
    run = micro_run(tmp_path / "run", rounds=(1.0, 1.3, 0.8))
    status, out, err = run_command(capsys, run, run)
    assert status == 0 and err == ""
    assert set(states(compare(run, run)).values()) == {SAME}
    assert out.splitlines()[-1] == "nothing slower beyond 10%"
    row = next(line for line in out.splitlines() if line.split()[:2] == ["grpc_tcp", "1KB"])
    assert "1.00" in row  # the ratio, with its range from the rounds
    assert "[0.62, 1.62]" in row


def test_a_transport_slowed_down_is_named_and_exits_1(tmp_path, capsys):
    base = micro_run(tmp_path / "base")
    new = micro_run(tmp_path / "new", factors={"grpc_tcp": 1.6}, grpc_tcp={"extra_copies": 1})
    status, out, err = run_command(capsys, base, new)
    assert status == 1 and err == ""
    comparison = compare(base, new)
    assert states(comparison) == {("grpc_tcp", 1024): SLOWER, ("grpc_tcp", 65536): SLOWER,
                                  ("zerocopy", 1024): SAME, ("zerocopy", 65536): SAME}
    assert [row.ratio for row in comparison.regressions] == pytest.approx([1.6, 1.6])
    lines = out.splitlines()
    assert lines[-1].startswith("slower beyond 10%: grpc_tcp (2 of 2 points") and "zerocopy" not in lines[-1]
    slowed = next(line for line in lines if line.startswith("+"))
    assert "grpc_tcp" in slowed and "1.60" in slowed and "extra_copies 0 -> 1" in slowed


def test_a_faster_transport_is_marked_and_exits_0(tmp_path, capsys):
    base = micro_run(tmp_path / "base")
    new = micro_run(tmp_path / "new", factors={"zerocopy": 0.5})
    status, out, _ = run_command(capsys, base, new)
    assert status == 0
    assert states(compare(base, new))[("zerocopy", 1024)] == FASTER
    assert [line.split()[1] for line in out.splitlines() if line.startswith("-")] == ["zerocopy", "zerocopy"]
    assert out.splitlines()[-1] == "nothing slower beyond 10%; faster: zerocopy"


def test_overlapping_rounds_are_the_same_though_the_medians_differ_beyond_the_threshold(tmp_path, capsys):
    base = micro_run(tmp_path / "base", rounds=(0.7, 1.0, 1.4))
    new = micro_run(tmp_path / "new", rounds=(0.9, 1.25, 1.6))  # median 1.25x, ranges overlap
    status, _, _ = run_command(capsys, base, new)
    comparison = compare(base, new)
    assert status == 0 and set(states(comparison).values()) == {SAME}
    assert comparison.rows[0].ratio == pytest.approx(1.25)
    assert comparison.rows[0].ratio_low == pytest.approx(0.9 / 1.4)
    assert comparison.rows[0].ratio_high == pytest.approx(1.6 / 0.7)
    # the same medians measured in three rounds each, with no noise between the rounds: slower
    three_base = micro_run(tmp_path / "three_base", rounds=(1.0, 1.0, 1.0))
    three_new = micro_run(tmp_path / "three_new", rounds=(1.25, 1.25, 1.25))
    assert set(states(compare(three_base, three_new)).values()) == {SLOWER}


def test_a_change_within_the_threshold_is_the_same_and_a_zero_threshold_leaves_it_to_the_noise(tmp_path):
    base = micro_run(tmp_path / "base")
    new = micro_run(tmp_path / "new", factors={"grpc_tcp": 1.05})
    comparison = compare(base, new)
    row = next(row for row in comparison.rows if row.point == ("grpc_tcp", 1024))
    assert row.state == SAME and row.marker == "~"
    assert comparison.exit_status() == 0
    assert compare(base, new, threshold=0.0).exit_status() == 1
    assert compare(base, new, threshold=0.04).exit_status() == 1
    assert compare(base, new, threshold=0.06).exit_status() == 0


def _samples_run(path, center: float, width: float, seed: int):
    rng = np.random.default_rng(seed)
    writer = RunWriter(path, "micro", {})
    times = center + width * rng.uniform(-1, 1, 201)
    record = micro("zerocopy", 1024, float(np.median(times)))
    writer.add(record)
    writer.add_samples(record, {"time_us": times, "transfer_us": times})
    writer.finish()
    return path


def test_a_single_round_is_not_called_however_narrow_the_interval_of_its_median(tmp_path, capsys):
    """The interval of one round's median bounds that round, not a second run (two single-round runs of an untouched
    grpc_tcp differed by up to 1.53x): a change is called from three rounds on, and the line says so."""
    base = _samples_run(tmp_path / "base", 100.0, 2.0, seed=1)
    narrow = _samples_run(tmp_path / "narrow", 120.0, 2.0, seed=2)
    comparison = compare(base, narrow)
    (row,) = comparison.rows
    assert row.state == NOT_CALLED and row.marker == "?" and row.base.spread == "samples"
    assert 99 < row.base.low < row.base.value < row.base.high < 101  # still shown: the median's interval
    assert row.ratio == pytest.approx(1.2, rel=0.02)
    assert comparison.exit_status() == 0
    status, out, _ = run_command(capsys, base, narrow)
    assert status == 0
    lines = out.splitlines()
    assert "1/1 round(s): --rounds 3 to call a change" in next(line for line in lines if line.startswith("?"))
    assert lines[-2] == ("not called: 1 point(s) measured in fewer than 3 rounds (base 1, new 1): one run's spread "
                         "does not bound another's; measure both with --rounds 3 to call a change")
    assert lines[-1] == "no change called: too few rounds (--rounds 3 in both runs calls one)"


def test_single_round_noise_of_1_53x_is_not_a_regression_but_a_planted_copy_in_3_rounds_is(tmp_path, capsys):
    # the stranger's runs: grpc_tcp untouched, 4 of 6 points up to 1.53x apart between two single-round runs
    sizes = (1024, 4096, 16384, 65536, 262144, 1048576)
    noise = dict(zip(sizes, (1.53, 1.2, 0.9, 1.35, 1.0, 1.3), strict=True))
    once = micro_run(tmp_path / "once", sizes=sizes, rounds=(1.0,))
    writer = RunWriter(tmp_path / "again", "micro", {})
    for size in sizes:
        for transport, time in TIMES.items():
            writer.add(micro(transport, size, time * noise[size] if transport == "grpc_tcp" else time))
    writer.finish()
    status, out, _ = run_command(capsys, once, tmp_path / "again")
    assert status == 0 and "+" not in [line[:1] for line in out.splitlines()]
    assert out.splitlines()[-1] == "no change called: too few rounds (--rounds 3 in both runs calls one)"
    # in three rounds, with that much noise between the rounds, the same 1.53x is within the noise...
    noisy = (0.7, 1.0, 1.5)
    base = micro_run(tmp_path / "base", sizes=sizes, rounds=noisy)
    new = micro_run(tmp_path / "new", sizes=sizes, rounds=tuple(r * 1.2 for r in noisy))
    assert compare(base, new).exit_status() == 0
    # ...and an extra copy that doubles zerocopy's time stands out of it
    planted = micro_run(tmp_path / "planted", sizes=sizes, rounds=(0.95, 1.0, 1.05), factors={"zerocopy": 2.5},
                        zerocopy={"extra_copies": 1})
    steady = micro_run(tmp_path / "steady", sizes=sizes, rounds=(0.95, 1.0, 1.05))
    comparison = compare(steady, planted)
    assert {row.point for row in comparison.regressions} == {("zerocopy", size) for size in sizes}
    assert comparison.exit_status() == 1


def test_the_machines_drift_measured_by_the_references_widens_the_threshold(tmp_path, capsys):
    base = micro_run(tmp_path / "base", references=("memcpy", "ucx_perftest"))
    # the whole machine 30% slower: references and transports alike, zerocopy 2x
    new = micro_run(tmp_path / "new", references=("memcpy", "ucx_perftest"),
                    factors={"memcpy": 1.3, "ucx_perftest": 1.3, "grpc_tcp": 1.3, "zerocopy": 2.0})
    comparison = compare(base, new)
    assert comparison.drift == pytest.approx(0.3)
    assert {row.point[0] for row in comparison.regressions} == {"zerocopy"}
    _, out, _ = run_command(capsys, base, new)
    assert ("note: the reference lines moved 30% between the runs (the median of their points): a change is called "
            "only beyond that, not 10%") in out.splitlines()


def model_run(path, times: dict[str, float], experiment: str = "model"):
    writer = RunWriter(path, experiment, {})
    for transport, step in times.items():
        writer.add({"transport": transport, "model": "fcn5", "batch_size": 4, "servers": 2, "steps": 10,
                    "step_time_s": step, "throughput_batches_per_s": 1 / step, "compute_s": step / 2,
                    "comm_s": step / 2})
    writer.finish()
    return path


def test_model_runs_compare_and_tf_grpc_is_a_reference(tmp_path, capsys):
    base = model_run(tmp_path / "base", {"zerocopy": 0.5, "grpc_tcp": 1.0, "tf_grpc": 1.0})
    slower_reference = model_run(tmp_path / "ref", {"zerocopy": 0.5, "grpc_tcp": 1.0, "tf_grpc": 2.0})
    status, out, _ = run_command(capsys, base, slower_reference)
    assert status == 0
    assert "references slower: tf_grpc" in out and out.splitlines()[-1] == "nothing slower beyond 10%"
    slower = model_run(tmp_path / "slow", {"zerocopy": 0.8, "grpc_tcp": 1.0, "tf_grpc": 1.0})
    status, out, _ = run_command(capsys, base, slower)
    assert status == 1
    assert states(compare(base, slower))[("zerocopy", "fcn5", 4, 2)] == SLOWER
    assert "800 ms" in out and "500 ms" in out
    assert out.splitlines()[-1].startswith("slower beyond 10%: zerocopy")
    # the throughput column is higher-is-better: the slower zerocopy has a ratio below 1 and is still slower
    by_throughput = compare(base, slower, metric="throughput_batches_per_s")
    (row,) = by_throughput.regressions
    assert row.ratio == pytest.approx(0.625)


def test_micro_reference_lines_never_fail(tmp_path, capsys):
    base = micro_run(tmp_path / "base", references=("memcpy",))
    new = micro_run(tmp_path / "new", factors={"memcpy": 3.0}, references=("memcpy",))
    status, out, _ = run_command(capsys, base, new)
    assert status == 0
    assert all(row.reference for row in compare(base, new).rows if row.state == SLOWER)
    assert "references (they measure the machine" in out and "references slower: memcpy" in out


def converge_run(path, seconds: dict[str, float | None], step_loss: float = 1.0):
    writer = RunWriter(path, "converge", {})
    for transport, time in seconds.items():
        for step in (1, 2):  # step rows are not compared, whatever they say
            writer.add({"kind": "step", "transport": transport, "task": "digits", "step": step, "wall_s": step * 9.0,
                        "train_loss": step_loss})
        writer.add({"kind": "summary", "transport": transport, "task": "digits", "time_to_target_s": time,
                    "target": "accuracy=0.97"})
    writer.finish()
    return path


def test_converge_compares_the_summaries_and_a_target_no_longer_reached_is_slower(tmp_path, capsys):
    base = converge_run(tmp_path / "base", {"grpc_tcp": 30.0, "zerocopy": 10.0})
    same = converge_run(tmp_path / "same", {"grpc_tcp": 30.0, "zerocopy": 10.0}, step_loss=99.0)
    comparison = compare(base, same)
    assert states(comparison) == {("grpc_tcp", "digits"): SAME, ("zerocopy", "digits"): SAME}
    slower = converge_run(tmp_path / "slower", {"grpc_tcp": 30.0, "zerocopy": 20.0})
    assert states(compare(base, slower))[("zerocopy", "digits")] == SLOWER
    lost = converge_run(tmp_path / "lost", {"grpc_tcp": 30.0, "zerocopy": None})
    status, out, _ = run_command(capsys, base, lost)
    assert status == 1 and "not reached" in out
    assert out.splitlines()[-1].startswith("slower beyond 10%: zerocopy")


def test_models_runs_compare(tmp_path):
    def models_run(path, ms):
        writer = RunWriter(path, "models", {})
        writer.add({"model": "vgg16", "variables": 32, "model_mb": 528.0, "batch_size": 1,
                    "compute_ms_per_sample": ms})
        writer.finish()
        return path

    base = models_run(tmp_path / "base", 500.0)
    assert compare(base, base).exit_status() == 0
    comparison = compare(base, models_run(tmp_path / "new", 700.0))
    assert states(comparison) == {("vgg16", 1): SLOWER} and comparison.group_column == "model"


def _version_1_run(path, factor: float = 1.0):
    """records.csv as written before rounds and samples existed: no round column, schema_version 1."""
    micro_run(path)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "schema_version": 1}))
    header = "transport,size_bytes,iters,p50_us,p99_us,mean_us,throughput_MBps,sender_cpu_s,receiver_cpu_s," \
             "copied_bytes_per_transfer"
    lines = [header] + [f"{t},{size},10,{time * factor},{time},{time},1.0,0.1,0.1,0"
                        for t, time in TIMES.items() for size in SIZES]
    (path / "records.csv").write_text("\n".join(lines) + "\n")
    return path


def test_a_version_1_run_compares(tmp_path, capsys):
    old = _version_1_run(tmp_path / "old")
    status, out, _ = run_command(capsys, old, old)
    assert status == 0 and "no spread measured" in out
    slower = _version_1_run(tmp_path / "slower", factor=1.6)
    assert compare(old, slower).exit_status() == 0  # measured once: too few rounds to call a change
    assert {row.state for row in compare(old, slower).rows} == {NOT_CALLED}
    assert {row.base.rounds for row in compare(old, slower).rows} == {1}


def test_points_of_base_missing_from_new_are_lost_and_exit_1(tmp_path, capsys):
    """A point of BASE that NEW does not have (a transport that failed or was left out) is lost: listed, named on the
    last line, exit status 1; the table of the points both have is still printed."""
    base = micro_run(tmp_path / "base", sizes=(1024, 65536))
    new = micro_run(tmp_path / "new", times={"zerocopy": 20.0, "local": 1.0}, sizes=(1024, 65536))
    status, out, err = run_command(capsys, base, new)
    assert status == 1 and err == ""
    lines = out.splitlines()
    assert "only in base (removed): grpc_tcp 1KB, grpc_tcp 64KB" in lines
    assert "only in new (added): local 1KB, local 64KB" in lines
    assert [line.split()[0] for line in lines if "µs" in line] == ["zerocopy", "zerocopy"]  # the table stays
    assert lines[-2] == "nothing slower beyond 10%"
    assert lines[-1] == ("lost: 2 point(s) of base not in new (grpc_tcp 1KB, grpc_tcp 64KB): they are not compared; "
                         "measure them again (or compare runs of the same points)")
    assert compare(base, new).exit_status() == 1


def test_points_only_in_new_or_of_a_reference_line_are_not_lost(tmp_path, capsys):
    base = micro_run(tmp_path / "base", references=("memcpy",))
    more = micro_run(tmp_path / "more", times={**TIMES, "local": 1.0})  # added points, and memcpy's removed
    status, out, _ = run_command(capsys, base, more)
    assert status == 0 and "only in new (added): local 1KB, local 64KB" in out
    assert "only in base (removed): memcpy 1KB, memcpy 64KB" in out and "lost" not in out
    assert compare(base, more).lost is None


def test_a_row_that_could_not_be_read_is_lost_and_exit_1(tmp_path, capsys):
    base = micro_run(tmp_path / "base")
    new = micro_run(tmp_path / "new")
    with open(new / "records.csv", "a") as records:
        records.write("zerocopy,262144,1,0,10,20.")  # a last row cut short: the run was killed writing it
    status, out, err = run_command(capsys, base, new)
    assert status == 1 and "its last row is cut short" in err
    assert out.splitlines()[-1] == ("lost: 1 row(s) of new's records.csv that could not be read (cut short): they are "
                                    "not compared; measure them again (or compare runs of the same points)")
    assert "nothing slower beyond 10%" in out  # every point it could read is the same


def test_only_changed_leaves_out_the_same_points(tmp_path, capsys):
    base = micro_run(tmp_path / "base")
    new = micro_run(tmp_path / "new", factors={"grpc_tcp": 2.0})
    _, out, _ = run_command(capsys, base, new, "--only-changed")
    table = [line.split()[:2] for line in out.splitlines() if "µs" in line]
    assert table == [["+", "grpc_tcp"], ["+", "grpc_tcp"]]
    assert "zerocopy" in out  # still counted in the summary
    _, everything, _ = run_command(capsys, base, new)
    assert [line.split()[0] for line in everything.splitlines() if "µs" in line].count("zerocopy") == 2


@pytest.mark.parametrize(("text", "value"), [("10%", 0.1), ("2.5%", 0.025), ("0.1", 0.1), ("0", 0.0), ("150%", 1.5)])
def test_thresholds_are_percentages_or_fractions(text, value):
    assert parse_threshold(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["-5%", "nan", "inf%", "fast", "10", ""])
def test_bad_thresholds_are_refused(text):
    with pytest.raises(CompareError, match="--threshold"):
        parse_threshold(text)


def _one_error_line(capsys, *argv) -> str:
    status, out, err = run_command(capsys, *argv)
    assert status == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench compare: error: ") and "; " in lines[0]
    assert "Traceback" not in err
    return lines[0]


def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys):
    run = micro_run(tmp_path / "run")
    (tmp_path / "empty").mkdir()
    assert "does not exist" in _one_error_line(capsys, tmp_path / "missing", run)
    assert "not a results directory" in _one_error_line(capsys, run, tmp_path / "empty")
    model = model_run(tmp_path / "model", {"zerocopy": 0.5})
    assert "a micro run and NEW" in _one_error_line(capsys, run, model)
    assert "--threshold" in _one_error_line(capsys, run, run, "--threshold=-10%")
    assert "choose one of" in _one_error_line(capsys, run, run, "--metric", "nonsense")
    other = micro_run(tmp_path / "other", times={"local": 1.0}, sizes=(4096,))
    line = _one_error_line(capsys, run, other)
    assert "no point in common" in line and "grpc_tcp 1KB" in line and "NEW has local 4KB" in line


def test_an_experiment_without_a_measure_is_refused(tmp_path, capsys):
    writer = RunWriter(tmp_path / "soak", "soak", {})
    writer.add({"phase": "micro", "transport": "zerocopy", "process": "sender", "tensors_sent": 1,
                "tensors_received": 1, "corrupted": 0, "lost": 0, "rss_start_mb": 1.0, "rss_end_mb": 1.0})
    writer.finish()
    assert "no headline measure" in _one_error_line(capsys, tmp_path / "soak", tmp_path / "soak")


def test_rounds_apart_by_less_than_the_threshold_are_no_regression_but_a_planted_copy_is(tmp_path, capsys):
    """Measured here, zerocopy at 1MB in 3 rounds: two untouched runs (51.1, 52.4, 75.8 and 78.0, 81.5, 101 µs) whose
    rounds lie apart by 3% only, and the same with --extra-copy zerocopy (100, 100, 101 µs): 32% apart at least."""
    def run(path, times_us):
        writer = RunWriter(path, "micro", {})
        for number, time_us in enumerate(times_us, start=1):
            writer.add(micro("zerocopy", 1 << 20, time_us, round=number))
        writer.finish()
        return path

    base = run(tmp_path / "base", (75.8, 52.4, 51.1))
    untouched = compare(base, run(tmp_path / "again", (78.0, 81.5, 101.0)))
    (row,) = untouched.rows
    assert row.state == SAME and row.marker == "~" and row.ratio_low == pytest.approx(78.0 / 75.8)
    assert untouched.exit_status() == 0
    planted = compare(base, run(tmp_path / "planted", (100.0, 100.0, 101.0)))
    assert [row.state for row in planted.rows] == [SLOWER] and planted.exit_status() == 1
