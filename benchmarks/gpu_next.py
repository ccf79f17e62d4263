"""The next GPU minutes, planned to move the figure: one command of under 9 minutes on a box with one GPU.

    python3 benchmarks/gpu_next.py --out $OUT --carried carried          # add --nanogpt peers/nanoGPT to race it

``carried/`` holds what the last job returned (copy ``$OUT`` there after each job); where it holds no table yet,
the table continues from the committed one of this card's model (benchmarks/results/gpu_check_h200.json on an
H200, else gpu_check.json). Then, each step only where what is left of ``--budget-s`` fits it:

1. **Go/no-go** (``gpu_levers.py gemms attention``, a child of about a minute): which levers can win at all. Our
   FP8 recipe (``fp8: rowwise_fwd_dgrad``) gets a training row only where the rowwise FP8 matmuls beat bf16's on
   the blocks' shapes by ``GO_FP8`` (its casts cost the rest); an attention backend only where the trainer can
   select it (``train.sdpa_backend``) and its forward and backward beat cuDNN's, which every switch runs, by
   ``GO_ATTENTION``. A faster kernel the trainer cannot select yet is named, not trained.
2. **The lever rows**: every switch on this card and, on top of it, the FP8 LM head (one run a side gained 2.5%,
   inside noise), the levers that passed, then Inductor's coordinate-descent tuning, as many as fit beside the
   profile and the compiled CUDA test, in ``ROUNDS`` alternating rounds; each lever judged by the CPU grid's noise
   rule (``Check.lever_rounds``).
3. **The profile** of every switch with the levers that won outside noise, and the compiled CUDA test on this
   card.
4. **nanoGPT's train.py** beside ours at each side's best, only where a lever won outside noise (``--nanogpt``),
   once for each such best (a lever that won in an earlier job: right after the go/no-go, before new rounds).
5. The rest of the CUDA tests, where time is left (else in the next job).

Every row reaches ``$OUT/gpu_check.json`` the moment it is measured, as with gpu_check.py, whose machinery this
is; the same command in the next job goes on where this one stopped. A CPU replays this plan with fake children
at the costs the committed table measured (tests/test_gpu_check_plan.py). Needs what gpu_check.py needs: torch,
numpy, click, pyyaml, pytest; no install, no network.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import gpu_check  # noqa: E402
from gpu_check import LEVERS, WARM_S, Budget, Check, Report  # noqa: E402
from gpu_levers import GEMMS  # noqa: E402

ROUNDS = 3  # the fewest whose paired ratios can agree on a direction against a spread (docs/benchmarks.md)
BUDGET_S = 530.0  # under the 9 minutes a 15-minute device lease leaves one command once the box has started
GO_FP8 = 1.15  # rowwise FP8 over bf16 on the blocks' matmuls: below it, the recipe's casts eat what is left
GO_ATTENTION = 1.03  # a selectable backend over cuDNN, forward and backward: less is inside a kernel's spread
PROBE_S = 90.0  # gpu_levers.py gemms attention: 15 s of matmuls, about a minute of attention (FlexAttention compiles)
# the blocks' four linear layers, forward and input gradient: where the recipe runs FP8 (not the head's matmuls)
BLOCK_SHAPES = [name for name in GEMMS if not name.startswith("LM head")]
# the kernels train.sdpa_backend can select: (the lever's name, its setting)
SELECTABLE = {"flash (SDPA)": ("+ SDPA flash backend", "flash"),
              "memory-efficient (SDPA)": ("+ SDPA memory-efficient backend", "efficient")}
REFERENCE_ATTENTION = "cuDNN (SDPA)"  # what every switch runs (sdpa_backend: cudnn)
HEAD = dict(LEVERS)["+ FP8 LM head"]
ROWWISE = "+ FP8 matmuls (rowwise, forward and input gradient)"
TUNING = "+ coordinate-descent tuning"


def committed_table(device: str) -> Path:
    """The committed table of this card's model: the H200's, else the H100's (where the levers were measured)."""
    return ROOT / "benchmarks/results" / ("gpu_check_h200.json" if "H200" in device else "gpu_check.json")


def start_table(json_path: Path, carried: Path | None, device: str) -> str:
    """The table this job continues, beside ``json_path``: what the last job returned, else the committed one, if
    either is of this card's model (a table of another model would be set aside by the report: it starts anew)."""
    def of_this_model(path: Path) -> bool:
        return path.is_file() and json.loads(path.read_text()).get("device") == device

    if json_path.exists():
        return f"continuing {json_path}"
    if carried is not None and of_this_model(carried / json_path.name):
        return f"carried from {carried}: " + ", ".join(gpu_check.bring_carried(carried, json_path))
    if of_this_model(committed_table(device)):
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_bytes(committed_table(device).read_bytes())
        return f"no table of the {device} carried: continuing {committed_table(device).relative_to(ROOT)}"
    return f"no table of the {device} carried or committed: a new table"


def probe_levers(out: Path, timeout_s: float) -> dict[str, Any]:
    """``gpu_levers.py gemms attention`` in a child: its tables beside the JSON (``levers.md``), its rows."""
    path = out / "levers.json"
    path.unlink(missing_ok=True)  # an earlier job's tables are not this card's
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(ROOT / "benchmarks/gpu_levers.py"), "gemms", "attention", "--json", str(path)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        (out / "levers.md").write_text(result.stdout + result.stderr)
    except subprocess.TimeoutExpired as exc:  # what it printed comes as bytes, whatever text= says
        printed = "".join(part.decode(errors="replace") if isinstance(part, bytes) else (part or "")
                          for part in (exc.stdout, exc.stderr))
        (out / "levers.md").write_text(printed + f"\ntimed out after {timeout_s:g} s\n")
    return json.loads(path.read_text()) if path.is_file() else {}  # gpu_levers.py writes it whole or not at all


def go_no_go(levers: dict[str, Any]) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """The levers worth training rows, in the order they run (the FP8 head first: its verdict is the nearest), and
    one line per decision, saying why."""
    chosen: list[tuple[str, dict[str, Any]]] = [("+ FP8 LM head", HEAD)]
    lines = ["FP8 LM head: a candidate (one run a side gained 2.5% on an H100, inside noise)"]
    gemms = {r["shape"]: r for r in levers.get("gemms", [])}
    blocks = [gemms.get(name) for name in BLOCK_SHAPES]
    if any(r is None or r["rowwise_ms"] is None or r["bf16_ms"] is None for r in blocks):
        lines.append("FP8 rowwise recipe: no-go: the rowwise FP8 matmuls did not run here (gpu_levers.py gemms)")
    else:
        speedup = sum(r["bf16_ms"] for r in blocks) / sum(r["rowwise_ms"] for r in blocks)
        go = speedup >= GO_FP8
        lines.append(f"FP8 rowwise recipe: {'go' if go else 'no-go'}: rowwise FP8 matmuls {speedup:.2f}× bf16's on "
                     f"the blocks' shapes (needs {GO_FP8:.2f}×)")
        if go:
            chosen.append((ROWWISE, dict(LEVERS)[ROWWISE]))
    kernels = {r["kernel"]: r for r in levers.get("attention", []) if "unavailable" not in r}
    reference = kernels.get(REFERENCE_ATTENTION)
    if reference is None:
        lines.append("attention: no-go: cuDNN's kernel, which every switch runs, did not run here")
        return chosen, lines
    cost = reference["forward_ms"] + reference["backward_ms"]
    faster = sorted(((cost / (r["forward_ms"] + r["backward_ms"]), name) for name, r in kernels.items()
                     if name != REFERENCE_ATTENTION and name != "math (reference)"), reverse=True)
    for speedup, name in faster:
        if speedup >= GO_ATTENTION and name in SELECTABLE:
            lever, backend = SELECTABLE[name]
            lines.append(f"attention: go: {name} {speedup:.2f}× cuDNN's forward and backward")
            chosen.append((lever, {"sdpa_backend": backend}))
            return chosen, lines
        if speedup >= GO_ATTENTION:
            lines.append(f"attention: {name} runs {speedup:.2f}× cuDNN's forward and backward, but the trainer "
                         "cannot select it yet: not trained")
    lines.append(f"attention: no-go: no kernel the trainer can select beats cuDNN's by {GO_ATTENTION:.2f}× "
                 f"({', '.join(f'{n} {s:.2f}×' for s, n in faster) or 'no other kernel ran'})")
    return chosen, lines


def fit(levers: list[tuple[str, dict[str, Any]]], check: Check, base: dict[str, Any], left_s: float,
        keep_s: float) -> list[tuple[str, dict[str, Any]]]:
    """The levers whose rounds fit in ``left_s`` beside the baseline's, ``keep_s`` kept for the profile and the
    tests: each configuration costs one cold row (its kind's expected cost here) and ROUNDS - 1 warm ones."""
    def rounds_s(config: dict[str, Any]) -> float:
        params = gpu_check.train_params(check.prof, config, check.prof["steps"])
        cold = check.expected_s(check.kind(params["train"]), params)
        return cold + (ROUNDS - 1) * min(cold, WARM_S)

    spent = rounds_s(base)
    chosen = []
    for name, change in levers:
        cost = rounds_s({**base, **change})
        if spent + cost <= left_s - keep_s:
            chosen.append((name, change))
            spent += cost
    return chosen


def judged(check: Check) -> dict[str, dict[str, Any]]:
    """Each lever's verdict from its rounds (where several cards judged it, the card listed last in the JSON's)."""
    latest: dict[str, dict[str, Any]] = {}
    for verdicts in check.report.data.get("lever rounds", {}).values():
        latest.update(verdicts)
    return latest


def winners(check: Check, base: dict[str, Any]) -> dict[str, Any]:
    """Every switch with each lever that won outside noise, the largest gain first where two set the same key."""
    verdicts = judged(check)
    won = sorted(((v["median"], name) for name, v in verdicts.items()
                  if not v["inside_noise"] and v["median"] is not None and v["median"] > 1), reverse=True)
    best, taken = dict(base), set()
    for _, name in won:
        change = dict(LEVERS).get(name) or attention_lever(name)
        if change is not None and not change.keys() & taken:
            best.update(change)
            taken |= change.keys()
    return best


def attention_lever(name: str) -> dict[str, Any] | None:
    """The change an attention lever of go_no_go's makes."""
    return next(({"sdpa_backend": backend} for lever, backend in SELECTABLE.values() if lever == name), None)


def still_to_come(check: Check, best: dict[str, Any]) -> float:
    """The time the rounds leave for what follows them: the profile of ``best`` where it was not taken (a lever that
    wins in them changes it, and its profile is then taken in the next job if this one has no time left) and the
    compiled CUDA test where this card has not run it."""
    train = gpu_check.train_params(check.prof, best, check.prof["steps"])["train"]
    profiled = (check.report.data.get("profile") or {}).get("train") == train
    tested = check.report.data.get("tests by card", {}).get(str(check.machine), {}).get("tests first")
    return (0.0 if profiled else WARM_S) + (0.0 if tested else gpu_check.COST_S["tests first"])


def raced(check: Check, best: dict[str, Any]) -> bool:
    """Whether ours at ``best`` and nanoGPT have run a best pair already, both halves measured (a pair a job
    split, or one whose nanoGPT half failed, is not)."""
    train = gpu_check.train_params(check.prof, best, check.prof["steps"])["train"]
    rows = check.report.data["rows"]
    ours = [r["name"][r["name"].index(" (best pair"):] for r in rows if r["name"].startswith("every switch")
            and " (best pair" in r["name"] and r.get("train") == train and "failed" not in r]
    return any(r["name"].startswith("nanoGPT's own train.py") and r["name"].endswith(pair) and "failed" not in r
               for pair in ours for r in rows)


def run_plan(check: Check, out: Path, nanogpt: Path | None, probe: Any = probe_levers) -> list[str]:
    """The plan on ``check``'s card, each step only where it fits; the lines that say what it decided. A lever
    judged in rounds by an earlier job is not measured again; where one won there and nanoGPT has not raced ours
    with it, that pair runs first."""
    lines: list[str] = []
    left: list[str] = []
    step = gpu_check.stepper(left)

    def left_s() -> float:
        return (check.budget.seconds or 1e9) - check.budget.spent()

    levers = probe(out, min(2 * PROBE_S, max(1.0, left_s())))
    candidates, decisions = go_no_go(levers)
    lines += decisions
    candidates.append((TUNING, dict(LEVERS)[TUNING]))  # built, never measured; the dearest compile: last
    base = check.all_switches()
    done = judged(check)
    if done.keys() & {name for name, _ in candidates}:
        lines.append(f"judged in rounds by an earlier job: {', '.join(n for n, _ in candidates if n in done)}")
        candidates = [(name, change) for name, change in candidates if name not in done]
    best = winners(check, base)
    if nanogpt is not None and best != base and not raced(check, best):  # a lever won in an earlier job
        check.nanogpt_pairs(nanogpt, 1, base, step, best=best)
    chosen = fit(candidates, check, base, left_s(), still_to_come(check, best))
    later = [name for name, change in candidates if (name, change) not in chosen]
    lines.append((f"rounds: every switch and {', '.join(n for n, _ in chosen)}, {ROUNDS} each" if chosen
                  else "rounds: none") + (f"; left for the next job: {', '.join(later)}" if later else ""))
    if chosen:
        for name, verdict in check.lever_rounds(base, chosen, ROUNDS, step).items():
            lines.append(f"{name.removeprefix('+ ')}: {gpu_check.lever_verdict(verdict)}")
    best = winners(check, base)
    step("profile", check.profile, best)
    step("tests (compiled)", check.tests, "tests first", gpu_check.FIRST_TESTS)
    if nanogpt is not None and best != base and not raced(check, best):
        check.nanogpt_pairs(nanogpt, 1, base, step, best=best)
    elif nanogpt is not None and best == base:
        lines.append("nanoGPT: not raced again: no lever won outside noise, so its ratio stands")
    step("tests (the rest)", check.tests, "tests", f"not {gpu_check.FIRST_TESTS}")
    if left:
        lines.append(f"left for the next job (too little of --budget-s): {', '.join(left)}")
    check.report.data.setdefault("plans", []).append({"date": check.report.data["date"],
                                                      "machine": check.machine, "decisions": lines})
    check.report.save()
    return lines


@click.command()
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="where the table (gpu_check.json), its logs and the levers' tables go")
@click.option("--carried", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="what the last job returned; without a table there, the committed table of this card's model")
@click.option("--nanogpt", default=None, type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="a checkout of karpathy/nanoGPT: raced again only where a lever won outside noise")
@click.option("--budget-s", default=BUDGET_S, show_default=True, type=float, help="this command's time")
@click.option("--tokens", default=None, help="token folder (default: data/tokens, else synthetic)")
def main(out: Path, carried: Path | None, nanogpt: Path | None, budget_s: float, tokens: str | None) -> None:
    import torch

    if nanogpt is not None:  # before anything is measured: a wrong folder would fail the race minutes in
        try:
            gpu_check.nanogpt_peer.check_checkout(nanogpt)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--nanogpt") from None
    if not torch.cuda.is_available():
        raise click.UsageError("no CUDA device here: the plan measures a GPU (its CPU replay is in the test suite)")
    budget = Budget(budget_s, 300.0, stretch=True)
    device = torch.cuda.get_device_name()
    json_path = out / "gpu_check.json"
    print(f"gpu_next: {start_table(json_path, carried, device)}", file=sys.stderr)
    report = Report(json_path, {"device": device, "torch": str(torch.__version__), "smoke": False,
                                "date": time.strftime("%Y-%m-%d")})
    probe = gpu_check.machine_probe()
    report.data["machines"][str(probe["uuid"])] = probe
    report.save()
    with tempfile.TemporaryDirectory() as tmp:
        token_dir = tokens or (str(ROOT / "data/tokens") if (ROOT / "data/tokens/meta.json").exists()
                               else str(gpu_check.synthetic_tokens(Path(tmp) / "tokens", 5_000_000)))
        check = Check(report, gpu_check.profile(False), True, False, token_dir, tmp, budget, probe["uuid"])
        lines = run_plan(check, out, nanogpt)
    report.data["seconds"] = round(report.data.get("seconds", 0.0) + budget.spent(), 1)
    report.save()
    print("\n".join(["", *lines, ""]))
    print(gpu_check.table(report.data["rows"], report.data["machines"]))


if __name__ == "__main__":
    main()
