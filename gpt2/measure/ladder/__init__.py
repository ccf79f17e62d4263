"""The optimization ladder: what each training optimization buys, measured here, as DVC experiments.

``ladder.yaml`` declares a baseline (everything off) and rungs, each the rung above plus one
change to params.yaml's ``train`` (or ``model``) section. Every rung runs as a real ``dvc exp``
of the ``train`` stage, one experiment at a time, repeated in alternating order (forward, then
backward) so that a machine warming up or slowing down does not pass for a speedup. The table
compares tokens/s (not step time: gradient accumulation changes the tokens per step) and keeps
the val loss after N steps in view, so a "speedup" that breaks training shows.

- spec.py: the ladder file, resolved on a device (each rung's params there);
- runs.py: the DVC experiments (schedule, run one at a time, reuse);
- stats.py: the typed result rows, speedups, what really ran, the noise;
- report.py: markdown, PNG, JSON and MLflow.
"""

from gpt2.measure.ladder.report import render_png, table, write_report
from gpt2.measure.ladder.runs import measured, normalized, run_ladder, schedule
from gpt2.measure.ladder.spec import (Ladder, Profile, Resolved, Rung, flat, load_ladder,
                                      resolve)
from gpt2.measure.ladder.stats import NO_EFFECT, Row, Spread, analyse, noise_verdict

__all__ = ["NO_EFFECT", "Ladder", "Resolved", "Profile", "Row", "Rung", "Spread", "analyse", "flat",
           "load_ladder", "measured", "noise_verdict", "normalized", "resolve", "render_png", "run_ladder", "schedule",
           "table", "write_report"]
