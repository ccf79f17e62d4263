"""The optimization ladder: what each training optimization buys, measured here, as DVC experiments.

``ladder.yaml`` declares a baseline (everything off) and rungs, each the rung above plus one
change to params.yaml's ``train`` (or ``model``) section. Every rung runs as a real ``dvc exp``
of the ``train`` stage, one experiment at a time, repeated in alternating order (forward, then
backward) so that a machine warming up or slowing down does not pass for a speedup; repeat r
trains the same seed on every rung. The table compares tokens/s (not step time: gradient
accumulation changes the tokens per step) and keeps the val loss in view, so a "speedup" that
breaks training shows.

- spec.py: the ladder file, resolved on a device (each rung's params there);
- runs.py: the DVC experiments, one at a time, then the report;
- report.py: the rungs as arms of the comparison (gpt2/measure/compare.py judges them), what ran, what
  wins, and the ladder's own columns of the report (gpt2/measure/report.py writes the rest).
"""

from gpt2.measure.ladder.report import CANNOT_SHOW, NO_EFFECT, arms, decide, write_report
from gpt2.measure.ladder.runs import run_ladder
from gpt2.measure.ladder.spec import Ladder, Profile, Resolved, Rung, flat, load_ladder, resolve

__all__ = ["CANNOT_SHOW", "NO_EFFECT", "Ladder", "Profile", "Resolved", "Rung", "arms", "decide", "flat",
           "load_ladder", "resolve", "run_ladder", "write_report"]
