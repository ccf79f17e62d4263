"""The one judge of the grid and the ladder (gpt2/measure/compare.py) and its report, on small tables of made-up runs:
inside noise, outside, faster but later to the reference's loss, failed, never reaching the loss, seeds, p-values."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from gpt2.measure import compare, parent_run, report, significance
from gpt2.measure.compare import Arm, Run, judge

WORDS = report.Words("setting", "the baseline")


def run(repeat: int, tokens_per_s: float, loss: float = 6.0, se: float = 0.005, curve=None, ok: bool = True) -> Run:
    return Run(f"r{repeat}", repeat, 1338 + repeat, ok=ok, tokens_per_s=tokens_per_s if ok else None,
               step_ms=1e6 / tokens_per_s if ok else None, peak_mem_gb=1.0, val_loss=loss if ok else None,
               val_loss_se=se if ok else None, curve=curve if ok else None)


def arm(label: str, figures: list[tuple], reference: int | None = 0) -> Arm:
    return Arm(label, [run(r, *f) for r, f in enumerate(figures)], reference=reference)


def label(a: Arm) -> str:
    return a.label


def test_speed_is_judged_run_by_run_against_the_reference_of_the_same_repeat():
    judged = judge([arm("base", [(100,), (90,), (110,)], None),  # the machine drifts: the pairs cancel it
                    arm("fast", [(150,), (135,), (165,)]),  # 1.5x in every pair
                    arm("same", [(104,), (88,), (112,)])])  # 1.04, 0.98, 1.02: straddles 1
    fast, same = judged.arms[1].versus.speed, judged.arms[2].versus.speed
    assert fast.median == 1.5 and fast.inside_noise is False
    assert same.inside_noise is True
    said = report.verdict(judged, WORDS, 3, [], label)
    assert "Faster outside noise: fast (1.50×)" in said and "same" not in said.split("Faster")[1]


def test_a_speed_gain_holds_a_t_test_against_the_noise_of_every_arm_s_runs():
    """Two repeats of one setting that moved tokens/s by 4% and 6% passed the floor (their own 2% range) as
    faster; one degree of freedom cannot say so at p < 0.01. Every arm's runs measure the machine's one noise (a
    pass of runs drifts together: randomized blocks), so a ladder's many arms decide what one cannot: the same
    two repeats of a 1.5× arm among five that moved within ±1% are decided."""
    one = judge([arm("base", [(100,), (100,)], None), arm("noop", [(104,), (106,)])])
    speed = one.arms[1].versus.speed
    assert compare.ratio_inside_noise(speed.paired, one.noise.speed_floor) is False  # the floor alone: "faster"
    assert speed.inside_noise is True and one.noise.speed_df == 1
    assert speed.test.p == pytest.approx(stats.ttest_1samp([math.log(1.04), math.log(1.06)], 0).pvalue)  # paired t
    said = report.decided(one, WORDS, label)
    assert said.startswith("No setting differs from the baseline outside noise")
    assert speed.test.seeds_needed == 4  # t(0.995, 3) + t(0.8, 3) = 6.82 times 0.0136 / √4 = 0.046 < log(1.05)
    assert f"Too few repeats to decide the speed of: noop (1.05×, {significance.p_text(speed.test.p)}; about 4 " \
           "repeats would decide a ratio this size) (the t-test " \
           "has 1 degree of freedom: more repeats, or more settings compared at once, give it more)." in said
    rates = [[100, 90], [101, 89.1], [100, 90.9], [100.5, 90.45], [101, 90], [99, 90], [150, 136.8]]  # pass 2: -10%
    many = judge([arm("base", [(r,) for r in rates[0]], None)] + [arm(f"a{i}", [(r,) for r in row])
                                                                 for i, row in enumerate(rates[1:])])
    fast = many.arms[-1].versus.speed
    logs = [[math.log(r) for r in row] for row in rates]
    grand = sum(map(sum, logs)) / 14
    residual = sum((v - sum(row) / 2 - sum(r[j] for r in logs) / 7 + grand) ** 2 for row in logs
                   for j, v in enumerate(row))
    t = (sum(logs[-1]) - sum(logs[0])) / 2 / math.sqrt(residual / 6 * 2 / 2)
    assert many.noise.speed_df == 6 and fast.test.p == pytest.approx(2 * stats.t.sf(t, 6))
    assert fast.inside_noise is False and fast.test.p < 0.01
    assert "against a run's noise read from every setting's runs (6 degrees of freedom), does not hold at p < " \
           "0.01" in report.noise_sentence(many, WORDS, 2)


def test_time_to_a_target_is_compared_run_by_run_where_both_reached_it():
    """The ladder's --target: the rung above's time over this rung's, repeat by repeat (not median over median,
    not overlapping ranges), tested as 'sooner' is; a run that did not reach it leaves its pair out."""
    base, fast, slow = (arm(name, [(100,), (100,), (100,)], ref) for name, ref in
                        (("base", None), ("fast", 0), ("half reached", 0)))
    for runs, times in ((base, (20.0, 22.0, 21.0)), (fast, (10.0, 11.2, 10.4)), (slow, (15.0, None, None))):
        for r, t in zip(runs.runs, times):
            r.target = {"reached": t is not None, "time_s": t, "tokens": 1.0, "steps": 1}
    judged = judge([base, fast, slow], target=6.0)
    fast_to, slow_to = judged.arms[1].versus.to_target, judged.arms[2].versus.to_target
    assert fast_to.paired == pytest.approx([2.0, 22.0 / 11.2, 21.0 / 10.4]) and fast_to.inside_noise is False
    assert slow_to.paired == pytest.approx([20.0 / 15.0]) and slow_to.inside_noise is True  # one pair: no verdict


def test_an_inert_arm_s_move_is_the_noise_floor():
    base = arm("base", [(100,), (100,)], None)
    inert = arm("inert", [(106,), (107,)])
    inert.inert = True
    small = arm("small", [(105,), (105.5,)])  # 5%: a gain, but under the 7% an arm that changed nothing moved
    judged = judge([base, inert, small])
    assert judged.noise.speed_floor == pytest.approx(0.065)
    assert judged.arms[2].versus.speed.inside_noise is True and judged.arms[1].versus.speed.inside_noise is True


def test_what_the_seeds_can_detect_is_read_from_arms_whose_loss_moves_from_seed_to_seed():
    """An arm that ran the baseline's numerics (a faster kernel, a data loader) moves the loss by 0 on every seed:
    it says nothing of the spread, and the sentence reads no '0.0000' from it."""
    base = arm("base", [(100, 6.00), (100, 6.02), (100, 5.99)], None)
    same = arm("same numerics", [(120, 6.00), (121, 6.02), (119, 5.99)])
    moved = arm("moved", [(100, 5.98), (100, 6.03), (100, 5.96)])
    said = report.seeds_sentence(judge([base, same, moved]), WORDS, 3)
    detectable = judge([base, moved]).arms[1].versus.loss.test.detectable
    assert f"a val loss difference smaller than {detectable:.4f} is likely missed" in said and detectable > 0
    assert "0.0000" not in said
    assert "likely missed" not in report.seeds_sentence(judge([base, same]), WORDS, 3)


def test_the_paired_t_test_is_scipy_s_and_says_what_more_seeds_would_decide():
    differences = [-0.031, -0.012, -0.026]
    test = significance.paired_test(differences, alpha=0.01)
    assert test.p == pytest.approx(stats.ttest_1samp(differences, 0.0).pvalue)
    half = stats.t.ppf(0.995, 2) * stats.sem(differences)
    assert (test.low, test.high) == pytest.approx((test.mean - half, test.mean + half))
    assert not test.significant and test.seeds_needed is not None
    sd = stats.tstd(differences)
    assert significance.detectable(sd, test.seeds_needed, 0.01) <= abs(test.mean)  # the fewest seeds that would
    assert significance.detectable(sd, test.seeds_needed - 1, 0.01) > abs(test.mean)
    assert significance.paired_test([0.0, 0.0, 0.0], 0.01).p == 1.0  # bit-identical runs: no difference
    assert significance.paired_test([0.1, 0.1], 0.01).p == 0.0 and significance.paired_test([0.1], 0.01) is None


def test_quality_counts_only_where_the_seeds_and_the_scored_text_both_say_so():
    base = [(100, 6.00), (100, 6.02), (100, 5.99), (100, 6.01)]
    judged = judge([arm("base", base, None),
                    arm("aa", [(100, 6.004), (100, 6.013), (100, 5.996), (100, 6.012)]),  # seed noise only
                    arm("lr", [(100, 5.80), (100, 5.83), (100, 5.78), (100, 5.81)]),  # -0.2 every seed
                    arm("tiny", [(100, 5.99), (100, 6.01), (100, 5.98), (100, 6.00)])],  # -0.01 every seed: the
                   alpha=0.01)  # seeds agree, but it is inside the scored text's 2 × √2 × 0.005
    aa, lr, tiny = (a.versus.loss for a in judged.arms[1:])
    assert aa.test.p > 0.2 and aa.apart is False
    assert lr.apart is True and lr.test.p < 0.01 and lr.delta == pytest.approx(-0.2, abs=1e-3)
    assert lr.per_seed == pytest.approx([-0.2, -0.19, -0.21, -0.2])
    assert tiny.test.significant and tiny.beyond_text_noise is False and tiny.apart is False
    said = report.verdict(judged, WORDS, 4, [], label)
    assert "Lower val loss outside noise: lr (-0.200, p < 0.0001)" in said and "aa (" not in said
    assert "repeat r trains seed 1338, 1339, 1340, 1341 (train.seed) for every setting" in said
    assert f"moves by {math.sqrt(sum((x - 6.005) ** 2 for x in (6.0, 6.02, 5.99, 6.01)) / 3):.4f}" in said
    cells = report.table(judged, [], report.columns(judged, WORDS))
    assert "| -0.200 ± " in cells and "(p = " in cells and "(inside noise)" in cells


def test_two_seeds_rarely_decide_and_the_verdict_says_how_many_would():
    judged = judge([arm("base", [(100, 6.00), (100, 6.03)], None),
                    arm("b", [(100, 5.94), (100, 5.98)])])  # -0.06 and -0.05: beyond the text, one degree of freedom
    loss = judged.arms[1].versus.loss
    assert loss.beyond_text_noise and not loss.test.significant and loss.apart is False
    said = report.verdict(judged, WORDS, 2, [], label)
    assert f"Too few seeds to decide the val loss of: b (-0.055, {significance.p_text(loss.test.p)}; about " in said
    assert compare.win(judged.arms[1], at_equal_time=False) is None


def curve(seconds_per_eval: float, losses: list[float]):
    return [(seconds_per_eval * (i + 1), 1000.0 * (i + 1), loss) for i, loss in enumerate(losses)]


def test_faster_steps_that_reach_the_loss_later_lose_and_a_sooner_arm_wins():
    base = [(100, 6.0, 0.005, curve(10, [7.0, 6.5, 6.0 + d])) for d in (0.0, 0.01, -0.01)]
    later = [(130, 7.0, 0.005, curve(8, [7.5, 7.2, 7.0 + d])) for d in (0.0, 0.01, -0.01)]  # never reaches 6.0
    sooner = [(100, 5.5, 0.005, curve(10, [6.5, 6.0 + d, 5.5])) for d in (0.0, 0.02, -0.02)]
    judged = judge([arm("base", base, None), arm("later", later), arm("sooner", sooner)])
    later_arm, sooner_arm = judged.arms[1], judged.arms[2]
    assert later_arm.versus.speed.inside_noise is False and later_arm.versus.speed.median == pytest.approx(1.3)
    assert later_arm.at_quality.reached == 0 and later_arm.versus.loss.apart
    assert compare.win(later_arm, at_equal_time=False) is None  # faster steps, a worse loss
    assert sooner_arm.at_quality.reached == 3 and sooner_arm.versus.sooner.median == pytest.approx(1.5)
    assert sooner_arm.versus.sooner.inside_noise is False and sooner_arm.versus.sooner.test.p < 0.01
    (score, _), why = compare.win(sooner_arm, at_equal_time=False)
    assert score == pytest.approx(1.5) and why.startswith("1.50× sooner to the same val loss (p = ")
    assert report.decide_best(judged, WORDS, held_out=False)[0][0] is sooner_arm
    assert "not reached (0/3)" in report.table(judged, [], report.columns(judged, WORDS))


def test_a_higher_loss_the_seeds_agree_on_counts_though_the_scored_text_is_noisier():
    """The scored text's bound (2 × √(se₁² + se₂²)) keeps a gain from being claimed; it never excuses a loss every
    seed agrees on: twice the tokens/s, 0.03 higher on every seed (p < 0.01), loses. The same 0.03 lower is no win."""
    def runs(tokens_per_s, shift, seconds_per_eval):
        return [(tokens_per_s, 6.0 + d + shift, 0.05, curve(seconds_per_eval, [7.0, 6.5, 6.0 + d + shift]))
                for d in (0.0, 0.011, -0.009)]

    base = arm("base", runs(100, 0.0, 10), None)
    worse = arm("fast but worse", [(200, loss + e, se, c) for (_, loss, se, c), e
                                   in zip(runs(200, 0.03, 5), (0.0, 0.002, -0.001))])
    better = arm("better", [(100, loss + e, se, c) for (_, loss, se, c), e
                            in zip(runs(100, -0.03, 10), (0.0, 0.002, -0.001))])
    judged = judge([base, worse, better])
    higher, lower = judged.arms[1].versus.loss, judged.arms[2].versus.loss
    assert higher.test.significant and higher.beyond_text_noise is False and higher.apart is True
    assert lower.test.significant and lower.beyond_text_noise is False and lower.apart is False
    assert compare.win(judged.arms[1], at_equal_time=False) is None
    assert report.decide_best(judged, WORDS, held_out=False)[0][0] is judged.arms[2]  # by reaching a loss sooner
    said = report.verdict(judged, WORDS, 3, [], label)
    assert "Higher val loss outside noise: fast but worse (+0.030, p = " in said and "Lower val loss" not in said


def test_losses_kept_to_4_decimals_that_moved_alike_on_every_seed_prove_nothing():
    """metrics.json keeps 4 decimals: two seeds that both read 0.0001 lower may differ by any amount that rounds so.
    The spread is taken as at least the rounding's; bit-identical runs still read p = 1."""
    judged = judge([arm("base", [(100, 6.0123), (100, 6.0321)], None),
                    arm("nearly", [(100, 6.0122), (100, 6.0320)]),
                    arm("same", [(100, 6.0123), (100, 6.0321)])])
    nearly, same = judged.arms[1].versus.loss, judged.arms[2].versus.loss
    assert nearly.delta == pytest.approx(-1e-4) and not nearly.test.significant and nearly.test.p > 0.1
    assert same.test.p == 1.0 and same.apart is False
    assert significance.paired_test([-1e-4, -1e-4], 0.01).p == 0.0  # without a resolution: exact differences, as given


def test_the_baseline_s_time_to_its_loss_is_read_at_a_loss_its_own_curves_reach():
    """Judged by evaluate's val loss, the noise paragraph's time still reads training's val curves: at the median of
    their last points, which every curve reaches, not at evaluate's loss (here lower than any eval of training's)."""
    base = arm("base", [(100, 6.0 + d, 0.005, curve(10, [7.0, 6.5, 6.0 + d])) for d in (0.0, 0.02, -0.02)], None)
    other = arm("b", [(100, 6.0 + d) for d in (0.0, 0.02, -0.02)])
    for r in base.runs + other.runs:
        r.eval_val_loss, r.eval_val_loss_se = r.val_loss - 0.05, 0.005
    judged = judge([base, other])
    assert judged.by == "evaluate" and judged.noise.time_to_loss is not None
    assert judged.noise.time_to_loss.median == pytest.approx((30.0 + 20 + 10 * 0.5 / 0.52) / 2)  # 6.02 never does
    assert "its time to its median final val loss (training's, on its val curve), 29.8 (" in report.seeds_sentence(
        judged, WORDS, 3)


def test_a_run_below_the_mark_at_its_first_eval_got_there_before_it_not_never():
    """Two evals a run (a short grid at the default eval interval): a run whose first eval is already below the
    baseline's final val loss reached it at an unknown time before that eval, which the table says, not "not
    reached"."""
    base = [(100, 6.8, 0.005, curve(10, [7.2, 6.8 + d])) for d in (0.0, 0.01)]
    early = [(100, 6.5, 0.005, curve(10, [6.7, 6.5 + d])) for d in (0.0, 0.01)]
    mixed = [(100, 6.5, 0.005, curve(10, [6.7, 6.5])), (100, 6.9, 0.005, curve(12, [7.5, 6.79]))]
    judged = judge([arm("base", base, None), arm("early", early), arm("mixed", mixed)])
    assert judged.arms[1].at_quality.reached == 0 and judged.arms[1].at_quality.early == 2
    shown = report.table(judged, [], report.columns(judged, WORDS))
    assert "| ≤ 10.0 s (already at the first eval, 2/2) |" in shown and "not reached" not in shown
    assert "23.7 (23.7–23.7) reached 1/2, ≤ 10.0 s (already at the first eval, 1/2) |" in shown


def test_failed_runs_come_first_and_no_verdict_is_read_from_runs_that_did_not_run():
    judged = judge([Arm("base", [run(0, 100, ok=False), run(1, 100, ok=False)]),
                    Arm("b", [run(0, 120, ok=False), run(1, 120, ok=False)], reference=0)])
    said = report.verdict(judged, WORDS, 2, [], label)
    assert said.startswith("**4 of 4 runs failed** (r0, r1, r0, r1; their output is in dvc.log): no setting could "
                           "be compared, so there is no verdict.")
    assert "No setting differs" not in said and judged.compared == []
    assert report.headline(judged, WORDS, label).startswith("4 of 4 runs failed (r0, r1, r0, r1; their output is in "
                                                            "dvc.log): no setting could be compared")
    assert "No setting differs" not in report.headline(judged, WORDS, label)  # the PNG's title
    judged = judge([arm("base", [(100,), (100,)], None), Arm("b", [run(0, 120), run(1, 120, ok=False)], reference=0)])
    said = report.verdict(judged, WORDS, 2, [], label)
    assert said.startswith("**1 of 4 runs failed** (r1; their output is in dvc.log): the verdict covers only")
    assert compare.win(judged.arms[1], at_equal_time=False) is None  # one pair: nothing wins
    assert "| 0/2 | failed |" not in report.table(judged, [], report.columns(judged, WORDS))  # one of two ran


def test_the_report_s_json_carries_the_seeds_and_p_values_and_the_png_draws(tmp_path):
    judged = judge([arm("base", [(100, 6.0), (101, 6.01), (99, 5.99)], None),
                    arm("b", [(120, 5.8), (121, 5.81), (119, 5.79)])])
    data = report.as_data(judged, "said", [])
    assert data["rows"][1]["versus"]["loss"]["test"]["p"] < 0.01
    assert [r["seed"] for r in data["rows"][1]["runs"]] == [1338, 1339, 1340]
    assert data["noise"]["seeds"] == [1338, 1339, 1340] and data["alpha"] == 0.01
    short, long = (report.render_png(judged, title, WORDS, label) for title in ("t", "a long title " * 40))
    assert short.startswith(b"\x89PNG")
    height = lambda png: int.from_bytes(png[20:24], "big")  # noqa: E731 (the PNG header's height field)
    assert height(long) > height(short)  # room for the title's wrapped lines
    assert parent_run.arm_metrics(1, judged.arms[1])["val_loss_p"] == pytest.approx(data["rows"][1]["versus"]["loss"][
        "test"]["p"])


def held(arm_: Arm, losses: list[float], se: float = 0.005) -> Arm:
    for run_, loss in zip(arm_.runs, losses):
        run_.holdout_loss, run_.holdout_loss_se = loss, se
    return arm_


def test_a_quality_win_is_applied_only_where_it_holds_on_the_held_out_windows():
    """A loop that picks winners on one set of val windows overfits them: --apply confirms on windows no verdict
    read. A speed win claims no quality, and needs no confirmation."""
    base = held(arm("base", [(100, 6.00), (100, 6.01), (100, 5.99)], None), [6.10, 6.11, 6.09])
    holds = held(arm("holds", [(100, 5.80), (100, 5.82), (100, 5.79)]), [5.90, 5.92, 5.89])
    overfit = held(arm("overfit", [(100, 5.80), (100, 5.81), (100, 5.79)]), [6.11, 6.09, 6.10])
    judged = judge([base, holds, overfit])
    assert compare.confirm(judged.arms[1]) == ""
    assert compare.confirm(judged.arms[2]).startswith("held-out val loss +0.000 (p = ")
    (best, _), said = report.decide_best(judged, WORDS, held_out=True)
    assert best is judged.arms[1] and "Not confirmed on the held-out windows, so not applied: overfit" in said
    judged = judge([base, overfit])
    assert report.decide_best(judged, WORDS, held_out=True)[0] is None
    unscored = judge([arm("base", [(100, 6.0), (100, 6.01), (100, 5.99)], None),
                      arm("b", [(100, 5.8), (100, 5.81), (100, 5.79)])])
    assert compare.confirm(unscored.arms[1]) == "not scored on held-out windows"
    (best, _), said = report.decide_best(unscored, WORDS, held_out=False)  # the report says what --apply would do
    assert best is unscored.arms[1] and "`--apply` first scores the runs on held-out val windows" in said
    fast = judge([arm("base", [(100,), (101,), (99,)], None), arm("fast", [(150,), (151,), (149,)])])
    assert compare.confirm(fast.arms[1]) == "" and report.decide_best(fast, WORDS, held_out=True)[0][0] is fast.arms[1]


def test_each_arm_s_mlflow_figures_have_a_name_of_their_own_that_mlflow_takes():
    """A label with a slash, or two labels that read alike once cleaned, must not stop the parent run's figures."""
    from mlflow.utils.validation import _validate_metric_name

    labels = ["train.lr=0.03", "download.source=data//x", "/abs/path", "train.lr 0.03", "x/../y", ""]
    names = parent_run.metric_names(labels)
    assert names[0] == "train.lr 0.03" and names[3] == "train.lr 0.03 3" and len(set(names)) == len(labels)
    for name in names:
        _validate_metric_name(f"val loss: {name}")
