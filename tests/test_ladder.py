"""gpt2 ladder: the ladder file, the runs it plans, the table it draws, and a real run through DVC."""

from __future__ import annotations

import json
import math
import sys

import pytest
import yaml
from conftest import ROOT, commit_all, exp_rows, mlflow_store, project_copy, run

from gpt2.core import paths
from gpt2.core.errors import UserError
from gpt2.measure import experiments, ladder
from gpt2.measure.compare import Spread, judge, read_run
from gpt2.measure.experiments import Experiment

PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())


def load(tmp_path, text: str) -> ladder.Ladder:
    path = tmp_path / "ladder.yaml"
    path.write_text(text)
    return ladder.load_ladder(path)


def test_the_projects_ladder_is_the_documented_one():
    spec = ladder.load_ladder(ROOT / "ladder.yaml")
    names = [r.name for r in spec.rungs]
    assert names == ["baseline", "ram preload", "vectorized batching", "keep host memory", "tf32", "amp",
                     "onednn head", "compile", "flash attention", "padded vocab", "fused adamw", "cudnn attention",
                     "bf16 residual", "liger loss", "fp8", "fp8 rowwise", "fp8 head", "kernel tuning", "max-autotune",
                     "cuda graphs", "grad accumulation", "muon"]
    assert all(len(r.changes) == 1 for r in spec.rungs[1:])  # one switch per rung
    assert set(spec.profiles) == {"cpu", "cuda"} and spec.profiles["cuda"].model == {"size": "gpt2"}


def test_each_rung_is_the_one_above_plus_its_change():
    spec = ladder.load_ladder(ROOT / "ladder.yaml")
    p = ladder.resolve(spec, PARAMS, "cpu")
    trains = [s["train"] for s in p.sections]
    assert trains[0]["dtype"] == "fp32" and trains[0]["data_loading"] == "memmap" and not trains[0]["compile"]
    flat = [ladder.flat(s) for s in p.sections]  # train keys bare, model keys as model.<key>, as rungs name them
    for i, rung in enumerate(spec.rungs[1:], 1):  # "above": the nearest rung above that runs here and carries
        above = flat[max(j for j in range(i) if not p.cannot_show[j] and spec.rungs[j].carries("cpu"))]
        changed = {k for k in flat[i] if flat[i][k] != above[k]}
        assert changed == set(rung.changes), rung.name
    assert flat[8]["model.attention"] == "flash" and flat[7]["model.attention"] == "manual"
    assert p.sets[8]["model.attention"] == "flash"  # what `dvc exp run -S` is given
    assert trains[-2]["grad_accum_steps"] == 2048 // (8 * 128)  # "target": the profile's batch in micro-batches
    assert trains[-1]["optimizer"] == "muon" and trains[-1]["target_val_loss"] is None
    assert all(t["max_steps"] == 13 and not t["save_checkpoint"] and t["resume"] == "never" for t in trains)
    assert {s["model"]["size"] for s in p.sections} == {"tiny"}
    assert p.sets[7]["train.compile"] is True and p.sets[7]["model.size"] == "tiny"
    assert trains[0]["cpu_gemm"] == "blas" and p.sets[6]["train.cpu_gemm"] == "onednn"


def test_a_rung_measured_beside_the_ladder_does_not_reach_the_rungs_below(tmp_path):
    """The levers are each tried alone on the same rung (Liger's loss and the FP8 head cannot even run
    together), and compile, which loses on a CPU, is not carried there: the rungs below run eager."""
    spec = ladder.load_ladder(ROOT / "ladder.yaml")
    names = [r.name for r in spec.rungs]
    cuda, cpu = ladder.resolve(spec, PARAMS, "cuda"), ladder.resolve(spec, PARAMS, "cpu")
    head = ladder.flat(cuda.sections[names.index("fp8 head")])
    assert head["fp8_head"] and head["loss_kernel"] == "torch" and head["fp8"] == "off"
    after = ladder.flat(cuda.sections[names.index("grad accumulation")])
    assert after["compile"] and (after["loss_kernel"], after["fp8"], after["fp8_head"]) == ("torch", "off", False)
    assert after["compile_mode"] == "default" and not after["compile_tuning"]
    assert ladder.flat(cpu.sections[names.index("compile")])["compile"]
    assert not any(ladder.flat(s)["compile"] for s in cpu.sections[names.index("flash attention"):])
    assert cpu.cannot_show[names.index("max-autotune")] == "train.compile is off"
    spec = load(tmp_path, "baseline: {compile: false, fused_adamw: false}\nrungs:\n"
                          "  - {name: compile, set: {compile: true}, carry: [cuda]}\n"
                          "  - {name: fused, set: {fused_adamw: true}}\nprofiles: {cpu: {repeats: 1}}\n")
    p = ladder.resolve(spec, PARAMS, "cpu")
    cpu_runtime = {"device": "cpu", "dtype": "fp32", "tf32": False, "device_name": "x"}
    judged = judged_of(spec, p, [[fake_run(p, 0, 100.0, cpu_runtime)], [fake_run(p, 1, 150.0, cpu_runtime)],
                                 [fake_run(p, 2, 80.0, cpu_runtime)]])
    assert judged.arms[1].reference == 0 and judged.arms[1].versus.speed.median == pytest.approx(100 / 150)
    assert judged.arms[2].reference == 0 and judged.arms[2].versus.speed.median == pytest.approx(100 / 80)
    text = table_of(tmp_path, judged, spec, p)
    assert "beside the ladder: on rung 0, and the rungs below do not take it" in text
    assert "on rung 0 (the rungs between are beside the ladder)" in text
    # two levers that each win alone were never measured together: --apply takes the faster, and names the other
    spec = load(tmp_path, "baseline: {fused_adamw: false, data_loading: memmap}\nrungs:\n"
                          "  - {name: fused, set: {fused_adamw: true}, carry: false}\n"
                          "  - {name: preload, set: {data_loading: preload}, carry: false}\n"
                          "profiles: {cpu: {repeats: 2}}\n")
    p = ladder.resolve(spec, PARAMS, "cpu")
    runs = [[fake_run(p, i, ms, cpu_runtime), fake_run(p, i, ms + 1, cpu_runtime, repeat=1)]
            for i, ms in enumerate((100, 50, 60))]
    changes, _ = ladder.decide(judged_of(spec, p, runs), spec, p, False, "ladder.md")
    assert [(c.key, c.value) for c in changes] == [("train.fused_adamw", True)]
    assert "'preload' also won alone, not applied with it (never measured together)" in changes[0].why
    with pytest.raises(UserError, match="carry must be true, false or a list of devices"):
        load(tmp_path, "baseline: {}\nrungs:\n  - {name: c, set: {compile: true}, carry: [gpu]}\n"
                       "profiles: {cpu: {}}\n")


def test_the_default_ladder_builds_every_rung_that_runs_on_a_cpu(tmp_path):
    """A rung this device cannot show (cuDNN attention) is not run, and its setting must not reach the rungs
    below it: each of them is built as the trainer builds it, with the kernel checks that refused it."""
    from gpt2.core.config import Params, build
    from gpt2.train.build import build as build_run
    from gpt2.train.describe import what_runs
    from conftest import make_tokens

    spec = ladder.load_ladder(ROOT / "ladder.yaml")
    p = ladder.resolve(spec, PARAMS, "cpu")
    tokens = make_tokens(tmp_path / "tokens")
    ran = []
    for rung, section, why in zip(spec.rungs, p.sections, p.cannot_show):
        if why:
            continue
        params = build(Params, {**section, "train": {**section["train"], "mlflow": False}}, "")
        what_runs(build_run(params, tokens))  # with the SDPA kernel check that refused cudnn on a CPU
        assert section["train"]["sdpa_backend"] == "auto" and section["train"]["residual_stream"] == "fp32", rung.name
        assert section["train"]["fp8"] == "off" and section["train"]["loss_kernel"] == "torch", rung.name
        ran.append(rung.name)
    assert ran[-3:] == ["fused adamw", "grad accumulation", "muon"]
    assert ("compile" in ran) == bool(ladder.spec._cxx_compiler())  # measured beside the ladder on a CPU
    from gpt2.measure.planned import Planned, too_short

    # its steps train at train.lr, past the learning rate's warm-up: nothing to warn of before the first run
    assert {section["train"]["warmup_steps"] for section in p.sections} == {3} and p.profile.steps == 13
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(PARAMS))  # the runs start from its 40-step warm-up
    assert too_short(tmp_path, [Planned(f"r{i}", sets, "", "") for i, sets in enumerate(p.sets)], "ladder") == []


def test_profile_follows_the_device_and_the_overrides():
    spec = ladder.load_ladder(ROOT / "ladder.yaml")
    cuda = ladder.resolve(spec, PARAMS, "cuda")
    assert cuda.sections[0]["model"]["size"] == "gpt2" and cuda.sections[0]["train"]["block_size"] == 1024
    assert cuda.sections[-1]["train"]["grad_accum_steps"] == 32
    mps = ladder.resolve(spec, PARAMS, "mps", model="gpt2", steps=7, repeats=3)
    assert mps.profile.steps == 7 and mps.profile.repeats == 3
    assert mps.sections[-1]["train"]["grad_accum_steps"] == 2  # 2048 tokens < one micro-batch: still accumulates
    assert mps.sections[0]["model"]["size"] == "gpt2" and mps.sections[0]["train"]["device"] == "mps"
    auto = {**PARAMS, "train": {**PARAMS.get("train", {}), "micro_batch_size": "auto", "batch_tokens": 65536}}
    cpu = ladder.resolve(spec, auto, "cpu")  # a params.yaml sized for its card: the ladder sets its own batch
    assert cpu.sections[-1]["train"]["micro_batch_size"] == 8 and cpu.sections[-1]["train"]["batch_tokens"] is None


def test_runs_go_in_alternating_order():
    from gpt2.measure.procedure import alternating

    assert alternating(3, 2) == [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1)]
    assert alternating(2, 1) == [(0, 0), (1, 0)]


@pytest.mark.parametrize("text, message", [
    ("baseline: {}\nrungs: []\nprofile: {}\n", "unknown key 'profile'"),
    ("rungs:\n  - name: x\n    set: {dtyp: bf16}\nprofiles: {cpu: {}}\n", "'dtyp' is not a params.yaml train key"),
    ("rungs:\n  - name: x\n    set: {}\nprofiles: {cpu: {}}\n", "changes nothing"),
    ("rungs:\n  - set: {compile: true}\nprofiles: {cpu: {}}\n", "needs a name"),
    ("rungs: []\nprofiles: {cuda: {}}\n", "profiles.cpu"),
    ("rungs: []\nprofiles: {cpu: {steps: 0}}\n", "profiles.cpu.steps = 0 is not allowed; expected an integer in"),
    ("rungs: []\nprofiles: {cpu: {stepz: 5}}\n", "unknown key 'profiles.cpu.stepz'; did you mean 'profiles.cpu.steps'"),
    ("rungs: []\nprofiles: {cpu: {target: -1.0}}\n", r"profiles.cpu.target = -1.0 .*null or a number > 0"),
    ("rungs:\n  - name: x\n    set: {compil: true}\nprofiles: {cpu: {}}\n", "did you mean 'compile'"),
    ("rungs: [\n", "not valid YAML"),
])
def test_bad_ladder_file_is_one_clear_error(tmp_path, text, message):
    with pytest.raises(UserError, match=message):
        load(tmp_path, text)


def test_bad_value_names_the_rung(tmp_path):
    spec = load(tmp_path, "rungs:\n  - name: half\n    set: {dtype: fp64}\nprofiles: {cpu: {}}\n")
    with pytest.raises(UserError, match="rung 'half'.*train.dtype"):
        ladder.resolve(spec, PARAMS, "cpu")
    spec = load(tmp_path, "rungs:\n  - name: acc\n    set: {grad_accum_steps: target}\n"
                          "profiles: {cpu: {target_batch_tokens: 1000}}\n")
    assert ladder.resolve(spec, PARAMS, "cpu").sections[1]["train"]["grad_accum_steps"] == 2  # at least 2


def test_missing_ladder_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        ladder.load_ladder(tmp_path / "nope.yaml")


def fake_run(p: ladder.Resolved, i: int, step_ms: float, runtime: dict, name: str = "", loss: float = 9.0,
             target_s: float | None = None, repeat: int = 0, se: float | None = None, curve=None,
             price: float | None = None):
    """Rung ``i``'s run of ``repeat`` as its experiment's files would record it, read as the ladder reads it."""
    train = p.sections[i]["train"]
    tokens = train["micro_batch_size"] * 128 * train["grad_accum_steps"]
    metrics = {"perf": {"step_ms": step_ms, "tokens_per_s": tokens / step_ms * 1000, "mfu": None},
               "mem": {"peak_gb": 1.0 + i}, "val": {"loss": loss, "loss_se": se, "bpb": loss / math.log(2) / 4}}
    if p.profile.target is not None:
        steps = None if target_s is None else round(target_s * 1000 / step_ms)
        metrics["target"] = {"reached": target_s is not None, "time_s": target_s, "steps": steps,
                             "tokens": None if steps is None else steps * tokens}
    summary = {"runtime": runtime, **({"cost": {"price_per_hour": price}} if price is not None else {})}
    exp = Experiment(name or f"ladder-{i:02d}-x-{repeat + 1}", f"rev{i}", "t", {"model": p.sections[i]["model"],
                     "train": p.sections[i]["train"]}, {paths.TRAIN_METRICS: metrics}, {paths.TRAIN_SUMMARY: summary})
    return read_run(exp.name, repeat, 1338 + repeat, exp, curve)


def judged_of(spec: ladder.Ladder, p: ladder.Resolved, runs: list[list]):
    return judge(ladder.arms(spec, p, runs), target=p.profile.target)


def table_of(tmp_path, judged, spec, p, changes=()) -> str:
    out = tmp_path / "report"
    out.mkdir(exist_ok=True)
    return ladder.write_report(out, judged, spec, p, list(changes))[0]


def test_a_cpu_gemm_rung_after_compile_is_read_as_no_effect(tmp_path):
    """A compiled step runs Inductor's matmuls whatever train.cpu_gemm says: the rung must not pass for a gain."""
    spec = load(tmp_path, "baseline: {compile: true, cpu_gemm: blas}\nrungs:\n"
                          "  - {name: onednn, set: {cpu_gemm: onednn}}\nprofiles: {cpu: {repeats: 1}}\n")
    p = ladder.resolve(spec, PARAMS, "cpu")
    cpu = {"device": "cpu", "dtype": "fp32", "tf32": False, "cpu_gemm": "inductor", "device_name": "x"}
    judged = judged_of(spec, p, [[fake_run(p, 0, 100.0, cpu)], [fake_run(p, 1, 95.0, cpu)]])
    assert judged.arms[1].inert and "| cpu_gemm=onednn → inductor |" in table_of(tmp_path, judged, spec, p)


def test_analysis_compares_tokens_per_second_and_names_inert_rungs(tmp_path):
    spec = load(tmp_path, "baseline: {tf32: false, model.pad_vocab: false, grad_accum_steps: 1}\nrungs:\n"
                          "  - {name: tf32, set: {tf32: true}}\n  - {name: pad, set: {model.pad_vocab: true}}\n"
                          "  - {name: accumulate, set: {grad_accum_steps: 4}}\n"
                          "profiles: {cpu: {repeats: 2}}\n")
    p = ladder.resolve(spec, PARAMS, "cpu")
    cpu = {"device": "cpu", "dtype": "fp32", "tf32": False, "sdpa_backend": "flash_attention", "device_name": "x"}
    runs = [[fake_run(p, 0, 100.0, cpu), fake_run(p, 0, 120.0, cpu, repeat=1)],
            [fake_run(p, 1, 100.0, cpu), fake_run(p, 1, 120.0, cpu, repeat=1)],  # tf32 asked, not on this device
            [fake_run(p, 2, 50.0, cpu), fake_run(p, 2, 60.0, cpu, repeat=1)],
            [fake_run(p, 3, 100.0, cpu, loss=8.0, se=0.0512), fake_run(p, 3, 120.0, cpu, repeat=1, loss=8.0)]]
    judged = judged_of(spec, p, runs)
    assert judged.arms[0].step_ms == Spread(110.0, 100.0, 120.0)
    assert judged.arms[1].inert and judged.arms[2].versus.speed.median == pytest.approx(2.0)
    # 4 micro-batches in 100 ms: twice the tokens/s of one in 50 ms, although the step is slower
    assert judged.arms[3].versus.speed.median == pytest.approx(2.0)
    assert judged.arms[3].vs_baseline.median == pytest.approx(4.0)
    text = table_of(tmp_path, judged, spec, p)
    assert "no effect on this device" in text and "110.0 (100.0–120.0)" in text and "| 4.00× |" in text
    assert "tf32=true → false" in text
    assert "| 8.000 ± 0.051 |" in text and "| 9.000 |" in text  # the val loss with its standard error, when known
    assert "val bits per byte" in text and "| 3.2461 |" in text  # 9 nats a token of 4 bytes: the field's unit


def test_rungs_a_device_cannot_show_are_known_before_running_and_not_run(tmp_path):
    spec = ladder.load_ladder(ROOT / "ladder.yaml")
    names = [r.name for r in spec.rungs]
    cpu = dict(zip(names, ladder.resolve(spec, PARAMS, "cpu").cannot_show))
    assert cpu["tf32"] == "TF32 is a CUDA (Ampere+) matmul mode" and cpu["amp"].startswith("AMP's dtype auto is fp32")
    assert cpu["cudnn attention"] == "cudnn attention is a CUDA kernel"
    assert cpu["cuda graphs"] == cpu["max-autotune"] == "train.compile is off"  # compile: beside the ladder here
    assert cpu["bf16 residual"].startswith("the residual stream is bf16 only")
    assert cpu["fp8"].startswith("FP8 tensor cores are CUDA's") and cpu["liger loss"].endswith("CUDA only")
    assert cpu["fp8 head"].startswith("FP8 tensor cores are CUDA's (a CPU runs FP8 matmuls through oneDNN")
    assert cpu["fp8 rowwise"] == cpu["fp8"]
    assert cpu["kernel tuning"] in ("coordinate-descent tuning tunes Inductor's Triton kernels, CUDA's",
                                    "train.compile is off")
    unshown = {"tf32", "amp", "cudnn attention", "bf16 residual", "liger loss", "fp8", "fp8 rowwise", "fp8 head",
               "kernel tuning", "max-autotune", "cuda graphs"}  # the last three: compile is beside the ladder here
    assert {n for n, why in cpu.items() if why} == unshown or not ladder.spec._cxx_compiler()
    cuda = dict(zip(names, ladder.resolve(spec, PARAMS, "cuda").cannot_show))
    missing = {name for name in ("torchao", "liger_kernel") if not ladder.spec._installed(name)}
    expected = {rung for rung, package in (("fp8", "torchao"), ("liger loss", "liger_kernel")) if package in missing}
    assert {n for n, why in cuda.items() if why} == expected | {"onednn head"}
    assert cuda["onednn head"] == "train.cpu_gemm picks a CPU's matmul library"
    if "liger_kernel" in missing:  # an optional package a GPU rung needs: known before the hour of runs
        assert cuda["liger loss"] == "liger-kernel is not installed (pip install liger-kernel)"
    p = ladder.resolve(spec, PARAMS, "cpu")
    runs = [[] if p.cannot_show[i] else [fake_run(p, i, 100.0 - i, CPU), fake_run(p, i, 101.0 - i, CPU, repeat=1)]
            for i in range(len(names))]
    judged = judged_of(spec, p, runs)
    assert judged.arms[4].skipped == "TF32 is a CUDA (Ampere+) matmul mode" and judged.arms[4].runs == []
    assert judged.arms[6].reference == 3  # oneDNN's rung is compared with the last rung that ran
    text = table_of(tmp_path, judged, spec, p)
    assert "| 4 | tf32 |  | not run |" in text
    assert "Not run, as this device cannot show them: tf32 (TF32 is a CUDA" in text


def test_failed_rung_is_marked_and_the_next_compares_with_the_last_measured(tmp_path):
    spec = load(tmp_path, "rungs:\n  - {name: a, set: {fused_adamw: false}}\n"
                          "  - {name: b, set: {model.pad_vocab: false}}\nprofiles: {cpu: {repeats: 1}}\n")
    p = ladder.resolve(spec, PARAMS, "cpu")
    cpu = {"device": "cpu", "dtype": "fp32", "tf32": False}
    failed = read_run("ladder-01-a-1", 0, 1338, None)
    judged = judged_of(spec, p, [[fake_run(p, 0, 100.0, cpu)], [failed], [fake_run(p, 2, 50.0, cpu)]])
    assert judged.arms[2].reference == 0 and judged.arms[2].versus.speed.median == pytest.approx(2.0)
    text = table_of(tmp_path, judged, spec, p)
    assert "| 1 | a |  | 0/1 | failed |" in text and text.startswith(f"# Optimization ladder: {spec.source} (")
    assert f"Each rung adds one change to the rung above ({spec.source});" in text
    assert "**1 of 3 runs failed** (ladder-01-a-1; their output is in dvc.log)" in text


# --------------------------------------------------------------------------- end to end


TWO_RUNGS = """
baseline: {model.attention: manual, model.pad_vocab: false, tf32: false}
rungs:
  - name: tf32
    set: {tf32: true}
  - name: flash attention
    set: {model.attention: flash}
profiles:
  cpu:
    train: {micro_batch_size: 2, timing_warmup_steps: 1, eval_windows: 2}
    steps: 3
    repeats: 1
"""


@pytest.mark.slow
def test_ladder_runs_every_rung_as_a_dvc_experiment(tmp_path, tmp_path_factory):
    mlflow = pytest.importorskip("mlflow")
    root = project_copy(tmp_path_factory, tmp_path)  # the experiments start from a commit with the tokens in dvc.lock
    mlflow_store(tmp_path_factory, root)
    (root / "two.yaml").write_text(TWO_RUNGS)
    (root / "one.yaml").write_text(TWO_RUNGS.replace("  - name: flash attention\n    set: {model.attention: flash}\n",
                                                     ""))  # its --apply is refused before any run
    commit_all(root)
    command = [sys.executable, "-m", "gpt2.cli", "ladder", "--device", "cpu", "--mlflow"]
    first = run(root, *command, "--ladder", "two.yaml")
    assert "train.seed 1338): 2 run(s); rung 1 'tf32' cannot show on cpu: TF32 is a CUDA" in first.stderr
    assert "[2/2] rung 2 'flash attention', repeat 1/1" in first.stderr
    report = root / "reports/ladder"
    table = (report / "ladder.md").read_text()
    assert "| 0 | baseline | baseline |" in table and "| 2 | flash attention | model.attention=flash → " in table
    assert "| 1 | tf32 |  | not run |" in table
    assert "MFU against this CPU's measured matmul peak (" in table
    assert (report / "ladder.png").read_bytes().startswith(b"\x89PNG")
    rows = json.loads((report / "ladder.json").read_text())["rows"]
    assert [len(r["runs"]) for r in rows] == [1, 0, 1] and rows[2]["vs_baseline"]["median"] > 0
    assert rows[0]["mfu"] is not None and rows[2]["runs"][0]["seed"] == 1338
    assert abs(rows[0]["val_loss"]["median"] - rows[2]["val_loss"]["median"]) < 1e-3  # one seed, the same math
    names = {r["Experiment"] for r in exp_rows(root)}
    assert {"ladder-00-baseline-1", "ladder-02-flash-attention-1"} <= names and not any("tf32" in n for n in names)
    client = mlflow.MlflowClient(f"sqlite:///{root.resolve()}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("gpt2").experiment_id])
    tagged = sorted(r.data.tags.get("ladder.rung", "") for r in runs if r.data.tags.get("dvc_exp_name"))
    assert tagged == ["baseline", "flash attention"]
    summary = [r for r in runs if r.data.tags.get("kind") == "ladder"]
    assert len(summary) == 1 and "speed vs base: flash attention" in summary[0].data.metrics
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == summary[0].info.run_id]
    assert sorted(r.data.tags["ladder.rung"] for r in children) == ["baseline", "flash attention"]
    assert summary[0].info.start_time <= min(r.info.start_time for r in children)  # it lasts as long as the ladder
    [flash] = [r for r in children if r.data.tags["ladder.rung"] == "flash attention"]
    assert flash.data.metrics["speed vs base"] > 0
    assert "speed in noise" in flash.data.metrics
    assert summary[0].inputs.dataset_inputs  # the data every rung trained on
    assert {a.path for a in client.list_artifacts(summary[0].info.run_id)} >= {"ladder.md", "ladder.png"}

    baseline, flash = rows[0]["at_quality"], rows[2]["at_quality"]  # each run read where it reaches the baseline's end
    assert baseline["vs_baseline"]["median"] == 1.0 and baseline["reached"] == 1 and baseline["time_s"]["median"] > 0
    assert flash["runs"] == 1 and ("not reached" in table or flash["time_s"]["median"] > 0)
    assert "time to the baseline's loss (s)" in table and "device-hours" in table
    assert "sooner vs ref: flash attention" in summary[0].data.metrics

    dirty = (root / "params.yaml").read_text()
    (root / "params.yaml").write_text(dirty + "# an edit\n")
    refused = run(root, *command, "--ladder", "one.yaml", "--apply", check=False)  # before any run
    assert refused.returncode == 2 and "params.yaml has uncommitted edits; --apply never overwrites" in refused.stderr
    assert "run(s)" not in refused.stderr


def test_the_ladder_refuses_to_time_beside_a_running_experiment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    (tmp_path / "two.yaml").write_text(TWO_RUNGS)
    monkeypatch.setattr(experiments, "check_repo", lambda root: None)
    monkeypatch.setattr(experiments, "pending",
                        lambda root, states: ["exp-1"] if "Running" in states else [])
    with pytest.raises(UserError, match=r"1 queued DVC experiment\(s\) running \(exp-1\); .*dvc queue kill"):
        ladder.run_ladder("two.yaml", device="cpu")


def test_a_ladder_stopped_by_ctrl_c_goes_on_from_its_finished_runs_when_run_again(tmp_path, monkeypatch, caplog):
    """The grid's way (tests/test_grid.py), in a CPU's ladder of two repeats (TF32 left out): Ctrl-C in the second
    run, which DVC saved all the same (the stop came as it ended), keeps the plan; the same command again keeps
    both runs and makes the other two. A name of the plan that another ladder took meanwhile gets a new one,
    and no other run's name moves for it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    (tmp_path / "two.yaml").write_text(TWO_RUNGS)
    monkeypatch.setattr(experiments, "check_repo", lambda root: None)
    monkeypatch.setattr(experiments, "pending", lambda root, states: [])
    monkeypatch.setattr(experiments, "uncommitted_params", lambda root, path: "")
    store, made = {}, []
    monkeypatch.setattr(experiments, "finished", lambda root, files=(): list(store.values()))

    def run_now(root, name, sets, target, log, run_name=None):
        made.append(name)
        store[name] = Experiment(name, "rev", "t", {}, {})
        if len(made) == 2:
            raise KeyboardInterrupt
        return 0

    monkeypatch.setattr(experiments, "run_now", run_now)
    with pytest.raises(UserError, match="ladder interrupted: .* the same command again goes on from them"):
        ladder.run_ladder("two.yaml", device="cpu", repeats=2, mlflow=False)
    assert "ladder: 2 of 3 rungs × 2 repeats on cpu (" in caplog.text and "): 4 run(s); rung 1 'tf32'" in caplog.text
    store["ladder-02-flash-attention-2"] = Experiment("ladder-02-flash-attention-2", "rev", "t", {}, {})  # another's
    with pytest.raises(UserError, match="did not finish"):  # these stand-in runs hold no figures
        ladder.run_ladder("two.yaml", device="cpu", repeats=2, mlflow=False)
    assert made == ["ladder-00-baseline-1", "ladder-02-flash-attention-1",
                    "ladder-02-flash-attention-3", "ladder-00-baseline-2"]
    assert not list((tmp_path / ".dvc/tmp").glob("gpt2-ladder-interrupted-*.json"))


CPU = {"device": "cpu", "dtype": "fp32", "tf32": False, "sdpa_backend": "flash_attention", "device_name": "x",
       "keep_host_memory": False}
NOISE_LADDER = ("baseline: {keep_host_memory: false, model.pad_vocab: false, fused_adamw: false}\nrungs:\n"
                "  - {name: pin, set: {keep_host_memory: true}}\n  - {name: pad, set: {model.pad_vocab: true}}\n"
                "  - {name: fused, set: {fused_adamw: true}}\nprofiles: {cpu: {repeats: 2}}\n")


def test_a_gain_inside_the_repeats_interval_or_the_inert_rungs_move_is_not_a_gain(tmp_path):
    spec = load(tmp_path, NOISE_LADDER)
    p = ladder.resolve(spec, PARAMS, "cpu")
    runs = [[fake_run(p, 0, 100.0, CPU), fake_run(p, 0, 104.0, CPU, repeat=1)],
            [fake_run(p, 1, 97.0, CPU), fake_run(p, 1, 99.0, CPU, repeat=1)],  # pinned memory: inert on a CPU, moved
            # 4%: the floor
            [fake_run(p, 2, 95.0, CPU), fake_run(p, 2, 96.5, CPU, repeat=1)],  # 2.4% faster: within the floor
            [fake_run(p, 3, 60.0, CPU), fake_run(p, 3, 61.0, CPU, repeat=1)]]  # 1.57x: a gain
    judged = judged_of(spec, p, runs)
    assert judged.arms[1].inert and judged.noise.speed_floor == pytest.approx(0.0407, abs=1e-4)
    assert judged.arms[2].versus.speed.inside_noise is True and judged.arms[3].versus.speed.inside_noise is False
    text = table_of(tmp_path, judged, spec, p)
    assert "| 1.02× (inside noise) |" in text and "| 1.58× |" in text
    assert "Speed noise: each rung's runs, paired with the rung above's" in text and "by up to 4.1%" in text
    # paired runs that disagree on the direction (1.08x, then 1.00x): inside noise whatever the floor
    runs[2] = [fake_run(p, 2, 90.0, CPU), fake_run(p, 2, 99.0, CPU, repeat=1)]
    assert judged_of(spec, p, runs).arms[2].versus.speed.inside_noise is True


def test_a_rung_that_changes_only_the_learning_rate_is_never_faster_or_slower(tmp_path):
    """A rung's own changes decide: an lr rung after a compile rung changes no step's work, the compile rung does."""
    spec = load(tmp_path, "baseline: {compile: false}\nrungs:\n  - {name: compiled, set: {compile: true}}\n"
                          "  - {name: lr, set: {lr: 0.003}}\nprofiles: {cpu: {repeats: 2}}\n")
    p = ladder.resolve(spec, PARAMS, "cpu")
    runs = [[fake_run(p, 0, 100.0, CPU), fake_run(p, 0, 101.0, CPU, repeat=1)],
            [fake_run(p, 1, 60.0, CPU), fake_run(p, 1, 61.0, CPU, repeat=1)],
            [fake_run(p, 2, 50.0, CPU), fake_run(p, 2, 51.0, CPU, repeat=1)]]  # 1.2x: this machine, not the lr
    judged = judged_of(spec, p, runs)
    assert not judged.arms[1].same_work and judged.arms[1].versus.speed.inside_noise is False
    assert judged.arms[2].same_work and judged.arms[2].versus.speed.inside_noise is True
    text = table_of(tmp_path, judged, spec, p)
    assert "Speed moved where it cannot" in text and "rung that changed no step's work here moved tokens/s by" in text


def test_a_ladder_too_noisy_to_read_says_so_first(tmp_path):
    spec = load(tmp_path, NOISE_LADDER)
    p = ladder.resolve(spec, PARAMS, "cpu")
    runs = [[fake_run(p, 0, 100.0, CPU), fake_run(p, 0, 400.0, CPU, repeat=1)],
            [fake_run(p, 1, 20.0, CPU), fake_run(p, 1, 380.0, CPU, repeat=1)],  # changed nothing, "5.97x faster"
            [fake_run(p, 2, 90.0, CPU), fake_run(p, 2, 300.0, CPU, repeat=1)],
            [fake_run(p, 3, 80.0, CPU), fake_run(p, 3, 350.0, CPU, repeat=1)]]
    report = table_of(tmp_path, judged_of(spec, p, runs), spec, p)
    assert report.splitlines()[2].startswith("**Too noisy to read speed:**")
    p1 = ladder.resolve(spec, PARAMS, "cpu", repeats=1)
    one_run = table_of(tmp_path, judged_of(spec, p1, [group[:1] for group in runs]), spec, p1)
    assert one_run.splitlines()[2].startswith("**One run per rung") and "run it with --repeats 3 or more" in one_run


def test_with_a_target_every_run_trains_to_it_and_the_table_gives_time_to_target(tmp_path):
    spec = load(tmp_path, NOISE_LADDER.replace("{repeats: 2}", "{repeats: 2, steps: 200, target: 6.1}"))
    p = ladder.resolve(spec, PARAMS, "cpu")
    train = p.sections[0]["train"]
    assert train["target_val_loss"] == 6.1 and train["stop_at_target"] and train["max_steps"] == 200
    assert train["eval_interval"] == 10 and train["eval_windows"] == 80  # params.yaml's eval size, not the profile's
    assert ladder.resolve(spec, PARAMS, "cpu", target=5.5).sections[0]["train"]["target_val_loss"] == 5.5
    runs = [[fake_run(p, 0, 100.0, CPU, target_s=20.0, loss=6.05), fake_run(p, 0, 100.0, CPU, target_s=22.0,
                                                                            loss=6.07, repeat=1)],
            [fake_run(p, 1, 100.0, CPU, target_s=21.0), fake_run(p, 1, 100.0, CPU, target_s=21.5, repeat=1)],
            [fake_run(p, 2, 100.0, CPU, target_s=10.0), fake_run(p, 2, 100.0, CPU, target_s=None, repeat=1)],
            [fake_run(p, 3, 100.0, CPU), fake_run(p, 3, 100.0, CPU, repeat=1)]]
    judged = judged_of(spec, p, runs)
    assert judged.arms[0].target.time_s.median == 21.0 and judged.arms[2].target.reached == 1
    to_target = judged.arms[2].versus.to_target  # against the inert rung above, run by run: one pair reached it
    assert to_target.paired == [pytest.approx(21.0 / 10)] and to_target.inside_noise is True
    text = table_of(tmp_path, judged, spec, p)
    assert "time to 6.1 (s)" in text and "| 21.0 (20.0–22.0) |" in text
    assert "mean val loss under" not in text  # runs stop at the target: their final losses are at or under it
    assert "10.0 (10.0–10.0) reached 1/2" in text and "| not reached |" in text and "| 2.10× (inside noise) |" in text


def test_rungs_compare_at_the_baseline_s_loss_and_the_winners_are_applied(tmp_path):
    spec = load(tmp_path, NOISE_LADDER.replace("{repeats: 2}", "{repeats: 3}"))
    p = ladder.resolve(spec, PARAMS, "cpu")
    assert p.sections[0]["train"]["eval_interval"] == 3  # 6 evals over the profile's 20 steps: a curve
    budget = ladder.resolve(spec, PARAMS, "cpu", time_budget_s=30.0).sections[0]["train"]
    assert budget["time_budget_s"] == 30.0 and budget["max_steps"] is None

    def curve(seconds: float, end: float):
        return [(seconds, 1e3, 9.5), (2 * seconds, 2e3, 9.2), (3 * seconds, 3e3, end)]

    def group(i: int, ms: float, seconds: float, end: float, spread: tuple = (0.0, 0.004, -0.003)):
        return [fake_run(p, i, ms + r, CPU, loss=end + d, se=0.001, repeat=r, curve=curve(seconds + r, end + d),
                         price=3600.0) for r, d in enumerate(spread)]  # a dollar a second: easy to read

    runs = [group(0, 100.0, 10.0, 9.0),
            [read_run("x", r, 1338 + r, None) for r in range(3)],  # pinned memory: failed
            group(2, 60.0, 6.0, 8.8),  # padded vocab: 1.7x the tokens/s, and sooner to the baseline's loss
            group(3, 40.0, 4.0, 9.5)]  # fast, learns worse: never reaches the baseline's loss
    judged = judged_of(spec, p, runs)
    pad, fused = judged.arms[2], judged.arms[3]
    assert pad.reference == 0 and pad.at_quality.vs_baseline.median == pytest.approx(30 / 16.2, rel=0.05)
    assert pad.versus.sooner.inside_noise is False and pad.versus.loss.apart
    assert fused.at_quality.reached == 0 and fused.versus.loss.apart and fused.versus.loss.delta == pytest.approx(0.7)
    changes, note = ladder.decide(judged, spec, p, False, "reports/ladder/ladder.md")
    # pad against the baseline (the rung between failed) ran with both changes: both are what won; not fused (worse)
    assert [(c.key, c.value) for c in changes] == [("model.pad_vocab", True), ("train.keep_host_memory", True)]
    assert (changes[0].why.startswith("rung 2 'pad' against the rung above: ")
            and "sooner to the same val loss (p = " in changes[0].why
            and "outside noise (reports/ladder/ladder.md)" in changes[0].why)
    text = table_of(tmp_path, judged, spec, p, changes)
    assert "| baseline |" in text and "| not reached (0/3) |" in text
    assert "cost to the baseline's loss (USD)" in text and "| +0.700 ± " in text
    assert ("The winning settings, which `--apply` would write had every run finished: "  # rung 1 failed: refused
            "model.pad_vocab=true, train.keep_host_memory=true.") in text
    data = json.loads((tmp_path / "report/ladder.json").read_text())
    assert data["apply"] == {"train.keep_host_memory": True, "model.pad_vocab": True}
    assert data["rows"][2]["versus"]["loss"]["test"]["p"] < 0.01
    budgeted = ladder.resolve(spec, PARAMS, "cpu", time_budget_s=30.0)
    said = table_of(tmp_path, judged_of(spec, budgeted, runs), spec, budgeted)  # under a budget: losses, judged
    assert "Higher val loss at equal time (30 s) outside noise: fused (+0.700, p " in said
