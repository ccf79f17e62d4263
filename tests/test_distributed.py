"""DDP and FSDP on CPU (gloo, 2 processes, forked or under torchrun): same results as one process, rank 0 writes,
checkpoints resume across off/ddp/fsdp and world sizes, faults end cleanly."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from conftest import (MICRO_MODEL, MICRO_TRAIN, ROOT, commit_all, dvc, environment, micro_params, mlflow_store,
                      project_copy, run, set_params)
from ddp_driver import forked_job, free_port

from gpt2.measure import experiments
from gpt2.run import checkpoint
from gpt2.train.trainer import train

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")
DRIVER = Path(__file__).with_name("ddp_driver.py")


def params_file(folder: Path, model: dict | None = None, **train_overrides) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump({"model": {**MICRO_MODEL, **(model or {})},
                                    "train": {**MICRO_TRAIN, **train_overrides}}))
    return path


def torchrun(folder: Path, tokens: Path, *extra: str, nproc: int = 2, model: dict | None = None,
             launcher: str = "fork", **train_overrides) -> subprocess.CompletedProcess:
    """A DDP job of tests/ddp_driver.py: its ranks forked (``fork``, no imports to pay) or started by a launcher
    (``torch.distributed.run``, ``gpt2.train.torchrun``) where the test is about what the launcher does."""
    params = params_file(folder, model, **{"distributed": "ddp", **train_overrides})
    argv = [str(params), str(tokens), str(folder / "ckpt.pt"), str(folder / "reports"), *extra]
    if launcher == "fork":
        return forked_job(argv, nproc)
    command = [sys.executable, "-m", launcher, "--standalone", f"--nproc-per-node={nproc}", str(DRIVER), *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def metrics(folder: Path) -> dict:
    return json.loads((folder / "reports/summary.json").read_text())


def train_losses(folder: Path) -> list[float]:
    rows = (folder / "reports/plots/train.tsv").read_text().splitlines()[1:]
    return [float(r.split("\t")[1]) for r in rows]


def test_ddp_in_one_process_equals_plain_training(tmp_path, tokens):
    import warnings

    plain = train(micro_params(max_steps=6), tokens, tmp_path / "a/ckpt.pt", tmp_path / "a/reports")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # DDP's deprecated switches are not what a user should read
        ddp = train(micro_params(max_steps=6, distributed="ddp"), tokens, tmp_path / "b/ckpt.pt",
                    tmp_path / "b/reports")
    assert train_losses(tmp_path / "a") == train_losses(tmp_path / "b")
    assert ddp["val"] == plain["val"] and ddp["perf"]["world_size"] == 1


def test_compiled_ddp_is_split_at_its_gradient_buckets_and_trains_as_compiled_plain(tmp_path, tokens, monkeypatch):
    """DDP wraps the compiled model; Dynamo compiles the model's forward while DDP's is running, so its DDPOptimizer
    cuts the graph at DDP's gradient buckets: each bucket's all-reduce can start while the backward goes on.
    Accumulation (``no_sync``) works, nothing breaks the graph, and the losses are compiled plain training's."""
    from torch._dynamo.backends import distributed as ddp_optimizer

    buckets: list[int] = []
    shown = ddp_optimizer.pretty_print_buckets
    monkeypatch.setattr(ddp_optimizer, "pretty_print_buckets", lambda b, cap: buckets.append(len(b)) or shown(b, cap))
    # the shapes of test_switches.py's compiled training (its loss chunk too): plain training's kernels are built once
    settings = dict(max_steps=3, eval_interval=3, compile=True, grad_accum_steps=2, loss_chunk=40, model={"n_layer": 1})
    train(micro_params(**settings), tokens, tmp_path / "a/ckpt.pt", tmp_path / "a/reports")
    assert not buckets  # no DDP, no split
    torch._dynamo.reset()  # else the DDP run would reuse plain training's graph: its guards hold for the same code
    ddp = train(micro_params(**settings, distributed="ddp"), tokens, tmp_path / "b/ckpt.pt", tmp_path / "b/reports")
    assert buckets == [2]  # DDP's 1 MB first bucket (the tied embedding and LM head), then the rest
    assert train_losses(tmp_path / "b") == pytest.approx(train_losses(tmp_path / "a"), rel=1e-5)
    assert ddp["runtime"]["graph_breaks"] == 0 and ddp["runtime"]["recompiles"] == 0


def test_fsdp_checkpoints_are_plain_ones_and_resume_across_modes_exactly(tmp_path, tokens, monkeypatch):
    """FSDP in one process trains bit for bit as plain training; a run cut under one mode ends under the other."""
    from training import interrupt_at

    from gpt2.train.signals import TrainingInterrupted

    straight = train(micro_params(), tokens, tmp_path / "plain/ckpt.pt", tmp_path / "plain/reports")
    for first, then in (("fsdp", "off"), ("off", "fsdp")):
        folder = tmp_path / f"{first}-then-{then}"
        interrupt_at(monkeypatch, 5)
        with pytest.raises(TrainingInterrupted):
            train(micro_params(distributed=first), tokens, folder / "ckpt.pt", folder / "reports")
        monkeypatch.undo()
        cut = checkpoint.load(folder / "ckpt.pt")
        assert cut["step"] == 6 and cut["model"].keys() == checkpoint.load(tmp_path / "plain/ckpt.pt")["model"].keys()
        assert sorted(cut["optimizer"][0]["state"]) == list(range(len(cut["optimizer"][0]["state"])))  # torch.optim's
        resumed = train(micro_params(distributed=then), tokens, folder / "ckpt.pt", folder / "reports")
        assert train_losses(folder) == train_losses(tmp_path / "plain") and resumed["val"] == straight["val"]


def test_fsdp_under_bf16_gathers_bf16_weights_and_trains_as_plain_bf16(tmp_path, tokens, monkeypatch):
    """FSDP2's mixed precision: the all-gathered weights the blocks compute with are bf16 (half the bytes moved),
    the shards stay fp32; the losses are plain bf16 training's within bf16's rounding."""
    from gpt2.train import sharded

    seen, shard = set(), sharded.shard

    def watched(model, device, param_dtype=None):
        shard(model, device, param_dtype)
        attn = model.transformer.h[0].attn.c_attn
        attn.register_forward_pre_hook(lambda module, args: seen.add(module.weight.dtype))

    monkeypatch.setattr(sharded, "shard", watched)
    params = dict(dtype="bf16", max_steps=4, eval_interval=4)
    plain = train(micro_params(**params), tokens, tmp_path / "a/ckpt.pt", tmp_path / "a/reports")
    fsdp = train(micro_params(distributed="fsdp", **params), tokens, tmp_path / "b/ckpt.pt", tmp_path / "b/reports")
    assert seen == {torch.bfloat16}
    assert checkpoint.load(tmp_path / "b/ckpt.pt")["model"]["transformer.h.0.attn.c_attn.weight"].dtype == torch.float32
    assert train_losses(tmp_path / "b") == pytest.approx(train_losses(tmp_path / "a"), abs=2e-2)
    assert fsdp["val"]["loss"] == pytest.approx(plain["val"]["loss"], abs=2e-2)


@pytest.mark.slow
def test_fsdp_on_two_ranks_matches_one_process_and_resumes_in_any_world_size(tmp_path, tokens):
    """Sharded over 2 gloo ranks: the single-process losses; cut at step 6 (SIGTERM on rank 0, the writer),
    resumed on 2 ranks and, from the same file, in 1 process."""
    batch = {"micro_batch_size": 2, "grad_accum_steps": 2}
    train(micro_params(micro_batch_size=4, grad_accum_steps=2), tokens, tmp_path / "one/ckpt.pt",
          tmp_path / "one/reports")
    cut = torchrun(tmp_path / "two", tokens, "--fault", "signal", "--fault-rank", "0", "--fault-step", "5",
                   distributed="fsdp", **batch)
    assert cut.returncode != 0 and "interrupted by SIGTERM at step 6/12" in cut.stderr, cut.stderr[-3000:]
    state = checkpoint.load(tmp_path / "two/ckpt.pt")
    assert state["world_size"] == 2 and state["params"]["train"]["distributed"] == "fsdp"
    (tmp_path / "alone").mkdir()
    shutil.copy(tmp_path / "two/ckpt.pt", tmp_path / "alone/ckpt.pt")
    resumed = torchrun(tmp_path / "two", tokens, distributed="fsdp", **batch)
    assert resumed.returncode == 0 and "resuming" in resumed.stderr, resumed.stderr[-3000:]
    assert train_losses(tmp_path / "two") == pytest.approx(train_losses(tmp_path / "one"), abs=1e-4)
    assert metrics(tmp_path / "two")["val"]["loss"] == pytest.approx(metrics(tmp_path / "one")["val"]["loss"], abs=1e-4)
    assert metrics(tmp_path / "two")["runtime"]["distributed"] == "fsdp"
    weights, reference = (checkpoint.load(tmp_path / f"{name}/ckpt.pt")["model"] for name in ("two", "one"))
    # Adam magnifies summation-order differences on rarely seen embedding rows (~1e-4); a step is lr = 1e-2
    assert all(torch.allclose(weights[k], reference[k], atol=1e-3) for k in reference)
    train(micro_params(micro_batch_size=4, grad_accum_steps=2), tokens, tmp_path / "alone/ckpt.pt",
          tmp_path / "alone/reports")
    assert train_losses(tmp_path / "alone") == pytest.approx(train_losses(tmp_path / "one"), abs=1e-4)


@pytest.mark.slow
def test_signal_on_one_rank_stops_both_at_the_same_step_and_resume_is_exact(tmp_path, tokens):
    """Syncing only at log steps (every 50), as on CUDA: a SIGTERM to one rank in step 6 stops both after step 7."""
    dropout = {"dropout": 0.1}  # each rank's own dropout stream must be restored too
    rare = {"model": dropout, "micro_batch_size": 2, "log_interval": 50, "eval_interval": 50}
    full = torchrun(tmp_path / "full", tokens, "--defer-syncs", **rare)
    assert full.returncode == 0, full.stderr[-3000:]
    cut = torchrun(tmp_path / "cut", tokens, "--fault", "signal", "--fault-rank", "1", "--fault-step", "5",
                   "--defer-syncs", **rare)
    assert cut.returncode != 0 and "interrupted by SIGTERM at step 7/12" in cut.stderr
    assert checkpoint.load(tmp_path / "cut/ckpt.pt")["step"] == 7
    resumed = torchrun(tmp_path / "cut", tokens, "--defer-syncs", **rare)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr
    assert train_losses(tmp_path / "cut") == train_losses(tmp_path / "full")


def test_no_rank_leaves_before_rank_0_has_written_the_reports(tmp_path, tokens):
    """A rank that crashes in its teardown after the last step (gloo's can abort at exit) makes torchrun stop the
    others: rank 0 must have written the checkpoint and the reports by then."""
    result = torchrun(tmp_path, tokens, "--crash-at-exit", "1", micro_batch_size=2, max_steps=4,
                      launcher="torch.distributed.run")
    assert result.returncode != 0  # rank 1's abort is the job's failure; nothing of rank 0's is lost
    assert metrics(tmp_path)["steps"] == 4, result.stderr[-3000:]
    assert checkpoint.load(tmp_path / "ckpt.pt")["step"] == 4


def test_a_left_group_is_kept_until_the_process_ends(monkeypatch):
    """Freed with the DDP model after the run, gloo's group joined its worker thread under the GIL while the worker
    waited for the GIL: a finished rank hung (its stacks, in a CI run of tests/test_optim.py). It is left, and kept."""
    from gpt2.train import distributed

    monkeypatch.setattr(distributed, "KEPT_UNTIL_EXIT", [])
    dist = distributed.dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    world = dist.group.WORLD
    distributed.shutdown(distributed.Dist(rank=0, world=1, grouped=True), finished=True)
    assert not dist.is_initialized() and distributed.KEPT_UNTIL_EXIT == [world]


def test_a_peer_gone_at_the_last_barrier_is_a_warning_and_the_group_is_still_left(monkeypatch, caplog):
    from gpt2.train import distributed

    calls = []

    def barrier():
        calls.append("barrier")
        raise RuntimeError("[gloo] Connection closed by peer")

    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "barrier", barrier)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: calls.append("destroy"))
    distributed.shutdown(distributed.Dist(rank=0, world=2, grouped=True), finished=True)
    assert calls == ["barrier", "destroy"] and "a peer left before the run's last barrier" in caplog.text
    calls.clear()
    distributed.shutdown(distributed.Dist(rank=0, world=2, grouped=True), finished=False)  # after an error: no wait
    assert calls == ["destroy"]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["hang", "kill"])
def test_a_rank_that_hangs_or_is_killed_is_an_error_not_a_wait(tmp_path, tokens, fault):
    """A rank slow in the first step (compilation) is waited for: dist_first_step_timeout_s. After it the short
    deadline holds: the same delay in step 3 is a failure. A rank killed by a signal (the kernel's OOM killer,
    kill -9) prints nothing: the launcher names it and its signal, and rank 0 says truthfully what is saved."""
    result = torchrun(tmp_path / fault, tokens, "--fault", fault, "--fault-rank", "1",
                      "--fault-step", "0,3" if fault == "hang" else "3", "--hang-s", "6", micro_batch_size=2,
                      dist_timeout_s=3.0, dist_first_step_timeout_s=60.0, checkpoint_interval=2,
                      launcher="gpt2.train.torchrun" if fault == "kill" else "fork")
    assert result.returncode != 0
    if fault == "hang":
        assert "step 2/12" in result.stderr, result.stderr[-3000:]  # the first step's 6 s were waited for
        assert "rank 0/2: a collective failed" in result.stderr and "train.dist_timeout_s = 3 s" in result.stderr
        return
    assert result.returncode == 128 + 9, result.stderr[-3000:]
    assert re.search(r"error: rank 1 \(pid \d+\) was killed by SIGKILL: it could print no error of its own",
                     result.stderr), result.stderr[-3000:]
    assert f"nothing more was saved: the last checkpoint is {tmp_path / 'kill/ckpt.pt'}" in result.stderr or \
        "rank 0/2" not in result.stderr  # rank 0 may have been stopped by the launcher before its own line
    assert checkpoint.load(tmp_path / "kill/ckpt.pt")["step"] == 2


def skypilot_nodes(project: Path, nodes: int = 2, base: dict[str, str] | None = None,
                   **extra: str) -> tuple[list[subprocess.Popen], list[Path]]:
    """docs/launch/gpt2-skypilot.yaml's run section as SkyPilot runs it on each node of a task (its variables
    set), on ``nodes`` "nodes" of this machine: rendezvous on 127.0.0.1, each in the project folder."""
    task = yaml.safe_load((ROOT / "docs/launch/gpt2-skypilot.yaml").read_text())
    env = {**(base or os.environ), **{k: str(v) for k, v in task["envs"].items()}, "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "GPT2_RDZV_PORT": str(free_port()), "SKYPILOT_NODE_IPS": "127.0.0.1\n" * nodes,
           "SKYPILOT_NUM_NODES": str(nodes), "SKYPILOT_NUM_GPUS_PER_NODE": "1", "SKYPILOT_TASK_ID": "sky-test",
           **extra}
    logs = [project / f"node{n}.log" for n in range(nodes)]
    started = []
    for n, log in enumerate(logs):
        started.append(subprocess.Popen(["bash", "-c", task["run"]], cwd=project, stdout=log.open("w"),
                                        stderr=subprocess.STDOUT, env={**env, "SKYPILOT_NODE_RANK": str(n)}))
        time.sleep(1)  # the first node hosts the rendezvous
    return started, logs


# Slurm's srun on this machine: the job's command once per node, each with its node's variables, its output to
# node<N>.log; it waits for all of them and ends with the first failure's code. scontrol names the nodes.
FAKE_SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((n = 0; n < SLURM_JOB_NUM_NODES; n++)); do
  SLURM_NODEID=$n SLURM_PROCID=$n "$@" > "node$n.log" 2>&1 &
  pids+=($!)
  sleep 1
done
code=0
for pid in "${pids[@]}"; do wait "$pid" || code=$?; done
exit $code
"""


def slurm_job(project: Path, nodes: int = 2, **env: str) -> subprocess.CompletedProcess:
    """docs/launch/gpt2.sbatch as sbatch would start it on ``nodes`` nodes of one Slurm job, here on this machine."""
    bin_dir = project / "fake-slurm"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", "#!/usr/bin/env bash\necho 127.0.0.1\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_NODELIST": "node[1-2]",
             "GPT2_GPUS_PER_NODE": "1", "GPT2_RDZV_PORT": str(free_port())}
    path = f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    return subprocess.run(["bash", str(ROOT / "docs/launch/gpt2.sbatch")], cwd=project, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "PATH": path, **slurm, **env}, timeout=240)


def test_the_slurm_script_says_what_it_lacks(tmp_path):
    script = ["bash", str(ROOT / "docs/launch/gpt2.sbatch")]
    outside = subprocess.run(script, cwd=tmp_path, capture_output=True, text=True,
                             env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    assert outside.returncode == 2 and outside.stderr == (
        "error: SLURM_JOB_NODELIST and SLURM_JOB_NUM_NODES are not set: submit this script with sbatch\n")
    no_tokens = slurm_job(tmp_path)
    assert no_tokens.returncode == 2 and no_tokens.stderr.startswith(
        f"error: data/tokens/meta.json not found in {tmp_path}: submit from the project folder, after dvc pull")


KUBEFLOW = ROOT / "docs/launch/gpt2-kubeflow.yaml"


def unread_keys(given: object, read: object, path: str = "") -> list[str]:
    """The keys of ``given`` (a manifest) that ``read`` (what the API's models made of it) lost: fields the API
    does not have, which Kubernetes would drop or refuse."""
    if isinstance(given, dict):
        return [lost for key, value in given.items()
                for lost in ([f"{path}.{key}"] if not isinstance(read, dict) or key not in read
                             else unread_keys(value, read[key], f"{path}.{key}"))]
    if isinstance(given, list):
        if not isinstance(read, list) or len(read) != len(given):
            return [f"{path}[]"]
        return [lost for i, (g, r) in enumerate(zip(given, read)) for lost in unread_keys(g, r, f"{path}[{i}]")]
    return []


def test_the_kubeflow_trainjob_is_one_the_trainer_api_reads_whole():
    """docs/launch/gpt2-kubeflow.yaml against Kubeflow Trainer's own models of its API (kubeflow-trainer-api, the
    version the manifest names): every field exists there with its type; the patch names the replicated job and
    the container that the torch-distributed runtime calls node, and mounts the volume where GPT2_PROJECT says."""
    from kubeflow_trainer_api.models.trainer_v1alpha1_train_job import TrainerV1alpha1TrainJob

    manifest = yaml.safe_load(KUBEFLOW.read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    job = TrainerV1alpha1TrainJob.from_dict(manifest)  # a wrong type or a missing required field raises
    assert unread_keys(manifest, job.to_dict()) == []
    typo = yaml.safe_load(KUBEFLOW.read_text())
    typo["spec"]["trainer"]["numNode"] = typo["spec"]["trainer"].pop("numNodes")
    assert unread_keys(typo, TrainerV1alpha1TrainJob.from_dict(typo).to_dict()) == [".spec.trainer.numNode"]
    assert job.spec.runtime_ref.name == "torch-distributed" and job.spec.trainer.num_nodes == 2
    [patch] = job.spec.runtime_patches[0].training_runtime_spec.template.spec.replicated_jobs
    pod = patch.template.spec.template.spec
    assert patch.name == "node" and [c.name for c in pod.containers] == ["node"]  # the runtime's job and container
    mounted = {m.name: m.mount_path for m in pod.containers[0].volume_mounts}
    project = next(e.value for e in job.spec.trainer.env if e.name == "GPT2_PROJECT")
    assert mounted["project"] == project and {v.name for v in pod.volumes} == set(mounted)


def without_git_identity(home: Path) -> dict[str, str]:
    """This process's environment as a fresh pod or VM has it: no git user (no GIT_* names, an empty home)."""
    home.mkdir(parents=True, exist_ok=True)
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("GIT_AUTHOR", "GIT_COMMITTER"))},
            "HOME": str(home), "XDG_CONFIG_HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1"}


def kubeflow_node(project: Path, rank: int, nodes: int, port: int, **env: str) -> subprocess.Popen:
    """The TrainJob's command as one of its pods runs it: the runtime's PET_* variables and the manifest's own,
    the project folder here instead of the volume's mount, and no git identity."""
    trainer = yaml.safe_load(KUBEFLOW.read_text())["spec"]["trainer"]
    own = {e["name"]: str(e["value"]) for e in trainer["env"] if "value" in e}
    pet = {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(rank),
           "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}
    return subprocess.Popen(trainer["command"], cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**without_git_identity(project.parent / "pod-home"), **own, **pet,
                                            "GPT2_PROJECT": str(project), "GPT2_JOB": "gpt2-k8s",
                                            "PYTHONPATH": str(ROOT),
                                            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **env})


def test_the_kubeflow_command_says_what_it_lacks(tmp_path):
    trainer = yaml.safe_load(KUBEFLOW.read_text())["spec"]["trainer"]
    outside = subprocess.run(trainer["command"], capture_output=True, text=True, cwd=tmp_path,
                             env={k: v for k, v in os.environ.items() if not k.startswith("PET_")})
    assert outside.returncode == 2 and outside.stderr.startswith(
        "error: PET_NNODES, PET_NODE_RANK and PET_MASTER_ADDR are not set: run this as a Kubeflow Trainer TrainJob")
    no_tokens = kubeflow_node(tmp_path, 0, 1, free_port())
    assert no_tokens.wait(timeout=30) == 2 and no_tokens.stdout.read().startswith(
        f"error: data/tokens/meta.json not found in {tmp_path}: fill the volume first")


def test_the_skypilot_task_says_what_it_lacks(tmp_path):
    run_section = yaml.safe_load((ROOT / "docs/launch/gpt2-skypilot.yaml").read_text())["run"]

    def node(ips: str, nodes: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", run_section], cwd=tmp_path, capture_output=True, text=True,
                              env={**os.environ, "SKYPILOT_NODE_IPS": ips, "SKYPILOT_NUM_NODES": nodes,
                                   "SKYPILOT_NODE_RANK": "1"})

    said = [node("", "2"), node("10.0.0.1\n", "2"), node("10.0.0.1\n10.0.0.2\n", "2")]
    assert [s.returncode for s in said] == [2, 2, 2]
    assert said[0].stderr == "error: SKYPILOT_NODE_IPS names no node: run this as a SkyPilot task (sky launch)\n"
    assert said[1].stderr.startswith("error: SKYPILOT_NODE_IPS names 1 node(s) and SKYPILOT_NUM_NODES says 2")
    assert said[2].stderr.startswith(f"error: data/tokens/meta.json not found on node 1 in {tmp_path}")


@pytest.mark.slow
def test_a_kubeflow_or_skypilot_node_trains_and_the_first_records_the_dvc_experiment(tmp_path, tmp_path_factory):
    """One pod of the TrainJob (torchrun reads the runtime's PET_* variables), evicted: the SIGTERM its first
    process gets reaches the ranks, which save. Applied again, it resumes, finishes, and the node holding rank 0
    records the run as a DVC experiment named after the TrainJob, with no git identity of its own. Then the
    SkyPilot task's first node runs the same params (the finished checkpoint: its reports, no step), records its
    experiment and pushes its outputs to the DVC remote; a clone pulls the experiment and its checkpoint as the
    task's comments say."""
    project = project_copy(tmp_path_factory, tmp_path)
    set_params(project, model=MICRO_MODEL, train={**MICRO_TRAIN, "distributed": "ddp", "max_steps": 100_000,
                                                  "eval_interval": 100_000})
    dvc(project, "remote", "add", "-d", "team", str(tmp_path / "remote"))
    dvc(project, "push")  # the team's remote holds the corpus and its tokens
    commit_all(project)
    evicted = kubeflow_node(project, 0, 1, free_port(), MLFLOW_TRACKING_URI="", GPT2_EXP_NAME="")
    for line in evicted.stdout:
        if "| loss " in line:
            evicted.send_signal(signal.SIGTERM)  # to bash, the pod's first process, as the kubelet sends it
            break
    said = evicted.stdout.read()
    assert evicted.wait(timeout=120) == 143, said[-3000:]
    assert "interrupted by SIGTERM at step" in said, said[-3000:]
    saved = checkpoint.load(project / "checkpoints/ckpt.pt")["step"]
    set_params(project, train={"max_steps": saved + 2})
    node = kubeflow_node(project, 0, 1, free_port(), MLFLOW_TRACKING_URI="", GPT2_EXP_NAME="")
    out = node.stdout.read()
    assert node.wait(timeout=120) == 0, out[-3000:]
    assert "gpt2-kubeflow: node 0 of 1, rendezvous at 127.0.0.1:" in out and f"resuming at step {saved}/" in out
    summary = json.loads((project / "reports/train/summary.json").read_text())
    assert summary["perf"]["world_size"] == 1 and summary["steps"] == saved + 2
    [ref] = [r for r in run(project, "git", "for-each-ref", "--format=%(refname)", "refs/exps").stdout.split()
             if "/gpt2-gpt2-k8s-" in r]  # a DVC experiment: its commit holds the params and figures that ran
    assert yaml.safe_load(run(project, "git", "show", f"{ref}:params.yaml").stdout)["train"]["distributed"] == "ddp"
    recorded = json.loads(run(project, "git", "show", f"{ref}:reports/train/metrics.json").stdout)
    assert recorded["val"]["loss"] == round(summary["val"]["loss"], 4)

    [sky], [log] = skypilot_nodes(project, nodes=1, base=without_git_identity(tmp_path / "vm-home"),
                                  GPT2_EXP_NAME="")
    assert sky.wait(timeout=120) == 0, log.read_text()[-3000:]
    home = tmp_path / "home"
    run(tmp_path, "git", "clone", "-q", str(project), str(home))
    run(home, "git", "remote", "add", "sky", str(project))  # `git remote add sky gpt2:sky_workdir` there
    dvc(home, "exp", "pull", "sky", "gpt2-sky-test")  # its git ref, and its outputs from the DVC remote
    dvc(home, "exp", "apply", "gpt2-sky-test")
    assert yaml.safe_load((home / "params.yaml").read_text())["train"]["max_steps"] == saved + 2  # what ran
    assert checkpoint.load(home / "checkpoints/ckpt.pt")["step"] == saved + 2


@pytest.mark.slow
def test_two_nodes_train_as_one_job_and_a_dead_node_is_an_error_on_the_other(tmp_path, tmp_path_factory):
    """2 nodes × 1 rank × micro-batch 2 × accumulation 2 see the batches of 1 process × micro-batch 4 ×
    accumulation 2: the Slurm script's job (docs/launch/gpt2.sbatch) with a stand-in srun that starts its two
    nodes here. Then the SkyPilot task's nodes (docs/launch/gpt2-skypilot.yaml): when one dies, the other ends
    with one error line."""
    project = project_copy(tmp_path_factory, tmp_path)  # a DVC project, committed: the job records its run in it
    tokens = project / "data/tokens"
    single = train(micro_params(micro_batch_size=4, grad_accum_steps=2), tokens, tmp_path / "one/ckpt.pt",
                   tmp_path / "one/reports")
    set_params(project, model=MICRO_MODEL, train={**MICRO_TRAIN, "distributed": "ddp", "micro_batch_size": 2,
                                                  "grad_accum_steps": 2, "mlflow": True})
    commit_all(project)
    job = slurm_job(project, OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI=mlflow_store(tmp_path_factory, project))
    logs = [project / f"node{n}.log" for n in (0, 1)]
    assert job.returncode == 0, job.stderr + logs[0].read_text()[-3000:]
    assert "2 node(s) × 1 rank(s), rendezvous at 127.0.0.1:" in job.stdout
    double = json.loads((project / "reports/train/summary.json").read_text())
    assert double["perf"]["world_size"] == 2 and double["tokens"] == single["tokens"]
    assert double["runtime"]["nodes"] == 2 and single["runtime"]["nodes"] == 1  # what ran, as MLflow tags it
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{project}/mlflow.db")
    [tracked] = client.search_runs([client.get_experiment_by_name("gpt2").experiment_id])  # rank 0's, alone
    assert tracked.data.tags["nodes"] == "2" and tracked.data.tags["world_size"] == "2"
    assert tracked.data.tags["system_metrics"].startswith("node 0's only, of 2")
    assert "ddp×2 on 2 nodes" in tracked.info.run_name
    [recorded] = [e for e in experiments.finished(project) if e.name == "gpt2-4242"]  # a DVC experiment, as dvc exp
    assert recorded.params["train"]["distributed"] == "ddp"  # the params that ran
    assert recorded.metrics["reports/train/metrics.json"]["val"]["loss"] == round(double["val"]["loss"], 4)
    rows = (project / "reports/train/plots/train.tsv").read_text().splitlines()[1:]
    assert [float(r.split("\t")[1]) for r in rows] == pytest.approx(train_losses(tmp_path / "one"), abs=1e-4)
    assert double["val"]["loss"] == pytest.approx(single["val"]["loss"], abs=1e-4)
    assert double["perf"]["tokens_per_s_per_device"] == pytest.approx(double["perf"]["tokens_per_s"] / 2, rel=1e-3)
    state = checkpoint.load(project / "checkpoints/ckpt.pt")
    assert state["world_size"] == 2 and len(state["rng_per_rank"]) == 2
    assert not any(k.startswith("module.") for k in state["model"])  # DDP's wrapper is not in the weights
    assert sum(log.read_text().count("step 12/12 | val loss") for log in logs) == 1  # only rank 0 logs

    params_file(project, distributed="ddp", micro_batch_size=2, max_steps=100_000, eval_interval=100_000,
                checkpoint_interval=100_000, log_interval=10, resume="never", dist_timeout_s=30.0)
    nodes, logs = skypilot_nodes(project)  # the SkyPilot task's run section on two nodes; one dies mid-run
    deadline = time.monotonic() + 120
    while not any("step 20/" in log.read_text() for log in logs) and time.monotonic() < deadline:
        time.sleep(0.2)
    main = next(n for n, log in enumerate(logs) if "step 20/" in log.read_text())  # rank 0 logs the steps
    other = psutil.Process(nodes[1 - main].pid)
    for process in [*other.children(recursive=True), other]:  # the node's launcher and its rank: gone at once
        process.kill()
    started = time.monotonic()
    assert nodes[main].wait(timeout=120) != 0
    assert time.monotonic() - started < 30  # a closed connection, noticed at once: not the deadline
    assert "error: rank 0/2: a collective failed" in logs[main].read_text()
    nodes[1 - main].wait(timeout=30)
    assert "gpt2-skypilot: node 1 of 2, rendezvous at 127.0.0.1:" in logs[1].read_text()


def test_ranks_that_find_different_checkpoints_stop_before_training_apart(tmp_path, tokens):
    """Nodes that do not share checkpoints/: rank 1 starts afresh while rank 0 would resume. Both stop at once
    with one error line, instead of training apart until a collective hangs."""
    stopped = torchrun(tmp_path, tokens, "--fault", "signal", "--fault-rank", "0", "--fault-step", "3")
    assert stopped.returncode == 143 and "saved" in stopped.stderr  # unfinished: rank 0 would resume it
    job = torchrun(tmp_path, tokens, "--no-checkpoint-on", "1")
    assert job.returncode != 0
    assert "error: the ranks found different checkpoints at" in job.stderr
    assert "every node must read the same" in job.stderr and "step 4/8" not in job.stderr


def test_torchrun_with_distributed_off_is_refused(monkeypatch):
    from gpt2.core.errors import UserError
    from gpt2.train import distributed

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets in each of its processes
    with pytest.raises(UserError, match="every process would train alone; set train.distributed: ddp"):
        distributed.init(micro_params().train, torch.device("cpu"))


@pytest.mark.slow
def test_the_train_stage_launches_ranks_that_save_on_its_sigterm_and_resume_writing_once(tmp_path, tmp_path_factory):
    """The DVC stage's command with 2 processes: it launches torchrun. A SIGTERM to it (what DVC or a scheduler
    sends) reaches the ranks, which save after a step and end before it does; `dvc repro` resumes, and rank 0 alone
    writes the checkpoint, the reports and the one MLflow run."""
    mlflow = pytest.importorskip("mlflow")
    root = project_copy(tmp_path_factory, tmp_path)
    set_params(root, train={"distributed": "ddp", "nproc_per_node": 2, "max_steps": 100_000})
    stage = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=root, stderr=subprocess.PIPE, text=True,
                             env=environment())
    lines = []
    for line in stage.stderr:  # the ranks train: step lines
        lines.append(line)
        if "| loss " in line:
            break
    stage.send_signal(signal.SIGTERM)
    rest = stage.stderr.read()
    assert stage.wait(timeout=60) == 143, "".join(lines) + rest
    errors = [line for line in rest.splitlines() if line.startswith("error:")]  # one line, rank 0's
    assert len(errors) == 1 and "interrupted by SIGTERM at step" in errors[0], rest
    assert "Traceback" not in rest and "ChildFailedError" not in rest, rest
    saved = checkpoint.load(root / "checkpoints/ckpt.pt")["step"]
    assert 0 < saved < 100_000
    with checkpoint.exclusive(root / "checkpoints/ckpt.pt"):  # no rank trains on, holding the checkpoint's folder
        pass

    set_params(root, train={"max_steps": saved + 2, "mlflow": True})
    mlflow_store(tmp_path_factory, root)
    done = dvc(root, "repro", "train")
    assert f"resuming at step {saved}/{saved + 2}" in done.stdout + done.stderr
    out = json.loads((root / "reports/train/summary.json").read_text())
    assert out["perf"]["world_size"] == 2 and out["steps"] == saved + 2
    assert [p.name for p in (root / "checkpoints").iterdir()] == ["ckpt.pt"]
    client = mlflow.MlflowClient(f"sqlite:///{root.resolve()}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("gpt2").experiment_id])
    assert len(runs) == 1 and runs[0].data.tags["world_size"] == "2"


def test_preload_under_ddp_shares_one_mapped_copy(tokens):
    """Several ranks must not each hold a private copy of the corpus: a read-only map of the file."""
    import numpy as np

    from gpt2.train.loader import TokenSplit

    private = TokenSplit(tokens, "train", "preload")
    shared = TokenSplit(tokens, "train", "preload", shared=True)
    assert not isinstance(private.array(), np.memmap) and isinstance(shared.array(), np.memmap)
    assert shared.array().flags.writeable is False and np.array_equal(shared.array(), private.array())

