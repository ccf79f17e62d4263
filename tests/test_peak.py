"""MFU on a CPU: the matmul peak measured once per machine, kept, and what the run divides by."""

from __future__ import annotations

import json

import pytest
import torch

from gpt2.model import loss
from gpt2.run import peak
from gpt2.train.trainer import train
from tests.conftest import micro_params

SMALL = ((64, 64, 64), (32, 16, 48))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "peaks.json"
    monkeypatch.setenv(peak.CACHE_ENV, str(path))
    monkeypatch.setattr(peak, "SHAPES", SMALL)
    monkeypatch.setattr(peak, "SECONDS_PER_SHAPE", 0.01)
    monkeypatch.setattr(peak, "busy_share", lambda seconds=0.3: 0.0)  # the other test worker is not "other work"
    return path


def test_measured_once_then_read_from_the_cache(cache, monkeypatch):
    first, fresh = peak.cpu_peaks()
    assert fresh and first["fp32"] > 0 and (first["bf16"] is None) == (not peak.bf16_is_native(torch.device("cpu")))
    assert json.loads(cache.read_text())[peak.machine_key(torch.get_num_threads())]["fp32"] == first["fp32"]
    monkeypatch.setattr(peak, "measure", lambda: pytest.fail("measured again"))
    assert peak.cpu_peaks() == (first, False)


def test_a_peak_measured_with_all_instructions_is_not_reused_under_an_isa_cap(cache, monkeypatch):
    """Capping the vector instructions (an AVX2 machine emulated on an AVX-512 one) is another machine to the
    cache: its MFU is against the peak it can reach."""
    for name in peak.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    whole = peak.machine_key(2)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert peak.isa_caps() == "ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2"
    assert peak.machine_key(2) == f"{whole} | ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2"


def test_a_benchmark_header_names_the_caps_and_the_cores_the_run_may_use(monkeypatch):
    for name in peak.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(peak.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(peak.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert peak.cpu_label().endswith(", 2 cores") and "(" not in peak.cpu_label()
    monkeypatch.setattr(peak.os, "sched_getaffinity", lambda pid: {0}, raising=False)  # taskset -c 0
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert peak.cpu_label().endswith(" (ATEN_CPU_CAPABILITY=avx2), 1 of 2 cores (affinity)")


def test_a_corrupt_or_foreign_cache_is_measured_around(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    assert peak.cpu_peaks()[1]
    other = {"another CPU | 64 logical cores | 64 threads | torch 9": {"fp32": 1.0}}
    cache.write_text(json.dumps(other))
    values, fresh = peak.cpu_peaks()
    assert fresh and json.loads(cache.read_text()).keys() == {*other, peak.machine_key(torch.get_num_threads())}


def test_the_best_shape_is_the_peak(monkeypatch):
    """The slow shape cannot pull the fast one's figure down: the peak is the best shape's median, on a clock that
    each matmul advances at its shape's rate (a real clock on a loaded machine would make this a coin toss)."""
    rates, now = {256: 100e9, 8: 1e9}, [0.0]

    def matmul(a, b, out):
        now[0] += 2 * a.shape[0] * a.shape[1] * b.shape[1] / rates[a.shape[0]]

    monkeypatch.setattr(peak.torch, "mm", matmul)
    monkeypatch.setattr(loss, "onednn_available", lambda: False)
    monkeypatch.setattr(peak.time, "perf_counter", lambda: now[0])
    assert peak.matmul_flops(torch.float32, ((256, 256, 256), (8, 8, 8)), 0.01) == pytest.approx(100e9)
    assert peak.matmul_flops(torch.float32, ((8, 8, 8),), 0.01) == pytest.approx(1e9)


def test_the_fp32_peak_is_the_faster_library_s(monkeypatch):
    """MKL runs fp32 at half an AMD chip's rate, where oneDNN (which the loss's head uses there) runs at all of it:
    the peak is the faster one's, else MFU would read above 100%. bf16 is timed through torch.mm alone."""
    now = [0.0]
    rates = {"blas": 100e9, "onednn": 200e9}

    def kernel(library):
        def run(a, b, out=None):
            now[0] += 2 * a.shape[0] * a.shape[1] * a.shape[1] / rates[library]
        return run

    monkeypatch.setattr(peak.torch, "mm", kernel("blas"))
    monkeypatch.setattr(loss, "onednn_mm", kernel("onednn"))
    monkeypatch.setattr(loss, "onednn_available", lambda: True)
    monkeypatch.setattr(peak.time, "perf_counter", lambda: now[0])
    assert peak.matmul_flops(torch.float32, ((64, 64, 64),), 0.01) == pytest.approx(200e9)
    assert peak.matmul_flops(torch.bfloat16, ((64, 64, 64),), 0.01) == pytest.approx(100e9)
    rates["onednn"] = 50e9
    assert peak.matmul_flops(torch.float32, ((64, 64, 64),), 0.01) == pytest.approx(100e9)


def test_a_cpu_run_reports_mfu_against_the_measured_peak(tokens, tmp_path, cache):
    cache.parent.mkdir(parents=True)
    key = peak.machine_key(torch.get_num_threads())
    cache.write_text(json.dumps({key: {"fp32": 1.0e11, "bf16": 4.0e11}}))
    metrics = train(micro_params(max_steps=3, timing_warmup_steps=1, mlflow=False), str(tokens), tmp_path / "c.pt",
                    report_dir=None)
    perf = metrics["perf"]  # the yardstick is bf16's peak where the CPU has one; the fp32 run's own is 4x smaller
    assert perf["mfu"] > 0 and perf["mfu_dtype"] == pytest.approx(4 * perf["mfu"], rel=2e-2)
    assert "measured matmul peak" in metrics["runtime"]["mfu_against"]


def test_gpt2_peak_measures_again_and_says_where_it_keeps_it(cache, runner):
    from gpt2.cli import main

    cache.parent.mkdir(parents=True)
    key = peak.machine_key(torch.get_num_threads())
    cache.write_text(json.dumps({key: {"fp32": 1.0, "bf16": None}}))  # a first measurement spoiled by other work
    result = runner.invoke(main, ["peak"])
    assert result.exit_code == 0, result.output
    assert "fp32:" in result.output and str(cache) in result.output
    assert json.loads(cache.read_text())[key]["fp32"] > 1.0


def test_a_measurement_only_raises_the_kept_peak_unless_fresh(cache, runner, monkeypatch):
    """One taken beside other work reads low: it must not lower the peak every MFU divides by."""
    from gpt2.cli import main

    cache.parent.mkdir(parents=True)
    key = peak.machine_key(torch.get_num_threads())
    cache.write_text(json.dumps({key: {"fp32": 1.0e18, "bf16": None}}))
    result = runner.invoke(main, ["peak"])
    assert result.exit_code == 0, result.output
    assert json.loads(cache.read_text())[key]["fp32"] == 1.0e18 and "an earlier measurement was higher" in result.output
    monkeypatch.setattr(peak, "measure", lambda: pytest.fail("measured although cached"))
    assert peak.cpu_peaks()[0]["fp32"] == 1.0e18
    monkeypatch.undo()
    monkeypatch.setenv(peak.CACHE_ENV, str(cache))
    monkeypatch.setattr(peak, "SHAPES", SMALL)
    monkeypatch.setattr(peak, "SECONDS_PER_SHAPE", 0.01)
    assert runner.invoke(main, ["peak", "--fresh"]).exit_code == 0  # the machine changed: forget the kept figure
    assert 0 < json.loads(cache.read_text())[key]["fp32"] < 1.0e18


def test_a_second_rank_reads_the_cache_but_never_measures_beside_the_first(cache, monkeypatch):
    monkeypatch.setattr(peak, "measure", lambda: pytest.fail("a second rank measured"))
    assert peak.cpu_peaks(may_measure=False) == (None, False)
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({peak.machine_key(torch.get_num_threads()): {"fp32": 1.0e11, "bf16": None}}))
    assert peak.cpu_peaks(may_measure=False) == ({"fp32": 1.0e11, "bf16": None}, False)


def test_an_unwritable_cache_is_measured_around(tmp_path, monkeypatch):
    monkeypatch.setattr(peak, "SHAPES", SMALL)
    monkeypatch.setattr(peak, "SECONDS_PER_SHAPE", 0.01)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(peak.CACHE_ENV, str(tmp_path / "a-file" / "peaks.json"))  # its folder cannot be made
    values, fresh = peak.cpu_peaks()
    assert fresh and values["fp32"] > 0
    from click.testing import CliRunner

    from gpt2.cli import main

    result = CliRunner().invoke(main, ["peak"])
    assert result.exit_code == 0 and "kept in" not in result.output
    assert f"not kept: {tmp_path / 'a-file' / 'peaks.json'} cannot be written" in result.output


def test_a_peak_measured_under_load_says_so_and_is_measured_again_when_quiet(cache, runner, monkeypatch):
    from gpt2.cli import main

    monkeypatch.setattr(peak, "busy_share", lambda seconds=0.3: 0.9)
    result = runner.invoke(main, ["peak"])
    assert result.exit_code == 0 and "measured under load: 90% of the cores" in result.output, result.output
    key = peak.machine_key(torch.get_num_threads())
    assert json.loads(cache.read_text())[key]["under_load"] is True
    assert peak.cpu_peaks()[1]  # still busy: measured again, still marked
    assert json.loads(cache.read_text())[key]["under_load"] is True
    monkeypatch.setattr(peak, "busy_share", lambda seconds=0.3: 0.0)
    assert peak.cpu_peaks()[1]  # quiet: measured again, and no longer marked
    assert json.loads(cache.read_text())[key]["under_load"] is False
    monkeypatch.setattr(peak, "measure", lambda: pytest.fail("measured again"))
    assert not peak.cpu_peaks()[1]


@pytest.mark.parametrize("kept", [{"fp32": 1.0e6, "bf16": None}, {"fp32": 1.0e6, "bf16": 4.0e6}])
def test_a_run_faster_than_the_kept_peak_raises_it_and_never_reads_above_100_percent(kept, tokens, tmp_path, cache,
                                                                                    caplog):
    """A peak measured beside other work (0.02 TFLOP/s for 0.2 idle) made runs log MFU of 90% and 112%."""
    cache.parent.mkdir(parents=True)
    key = peak.machine_key(torch.get_num_threads())
    cache.write_text(json.dumps({key: kept}))
    metrics = train(micro_params(max_steps=6, timing_warmup_steps=1, log_interval=1, mlflow=False), str(tokens),
                    tmp_path / "c.pt", report_dir=tmp_path / "reports")
    raised = json.loads(cache.read_text())[key]
    assert raised["fp32"] > 1.0e6 and raised["raised_by_run"]
    assert "above the kept CPU matmul peak" in caplog.text
    rows = (tmp_path / "reports/plots/train.tsv").read_text().splitlines()
    column = rows[0].split("\t").index("mfu")
    logged = [float(r.split("\t")[column]) for r in rows[1:] if r.split("\t")[column]]
    assert logged and max(logged) <= 1.0 and 0 < metrics["perf"]["mfu"] <= 1.0
    assert metrics["perf"].get("mfu_dtype", metrics["perf"]["mfu"]) <= 1.0


def test_a_peak_tflops_below_the_runs_rate_is_not_a_utilization_above_100_percent(tokens, tmp_path, caplog):
    metrics = train(micro_params(max_steps=4, timing_warmup_steps=1, mlflow=False, peak_tflops=1.0e-9), str(tokens),
                    tmp_path / "c.pt", report_dir=None)
    assert 0 < metrics["perf"]["mfu"] <= 1.0 and "set train.peak_tflops to the device's" in caplog.text
