"""tools/compare.py: its statistics against closed forms and scipy, and compare.md / every plot from run folders
written here with known numbers (no training)."""
import json
import math
import sys

import numpy as np
import pytest
import scipy.stats
from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import compare  # noqa: E402


def test_t_interval_is_scipys():
    values = [0.31, 0.35, 0.29, 0.40]
    mean, low, high = compare.t_interval(values)
    want = scipy.stats.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=scipy.stats.sem(values))
    assert mean == pytest.approx(np.mean(values)) and (low, high) == pytest.approx(want)
    assert math.isnan(compare.t_interval([1.0])[1])  # one value: no interval


def test_paired_interval_and_p_better_are_scipys_t():
    a, b = np.array([0.52, 0.61, 0.58, 0.49]), np.array([0.50, 0.49, 0.57, 0.51])
    for higher in (True, False):
        cmp = compare.paired_comparison(a, b, higher_is_better=higher)
        ref = scipy.stats.ttest_rel(a, b)
        assert (cmp["low"], cmp["high"]) == pytest.approx(tuple(ref.confidence_interval(0.95)))
        # P(true mean difference > 0) under the t distribution of the mean: t.cdf of the t statistic
        want = scipy.stats.t.cdf(ref.statistic, len(a) - 1)
        assert cmp["p_better"] == pytest.approx(want if higher else 1 - want)
    # The two seeds (d = 0.073, 0.087): a bootstrap said [0.073, 0.087]; the t-interval is ten times wider.
    two = compare.paired_comparison([0.173, 0.187], [0.1, 0.1], higher_is_better=True)
    half = scipy.stats.t.ppf(0.975, 1) * np.std([0.073, 0.087], ddof=1) / np.sqrt(2)
    assert (two["low"], two["high"]) == pytest.approx((0.08 - half, 0.08 + half)) and two["low"] < 0 < two["high"]
    same = compare.paired_comparison([0.5, 0.75, 1.0], [0.25, 0.5, 0.75], higher_is_better=False)  # no spread
    assert same["p_better"] == 0.0 and same["low"] == same["high"] == 0.25


@pytest.mark.parametrize("n", [2, 3, 5])
def test_the_paired_interval_covers_95_percent_at_small_n(n):
    """Normal differences, 2000 draws: the t-interval covers the true mean 95% of the time (a percentile
    bootstrap covers 50% at n = 2, about 75% at n = 3)."""
    rng = np.random.default_rng(n)
    hits = 0
    for _ in range(2000):
        cmp = compare.paired_comparison(rng.normal(0.3, 1.0, n), np.zeros(n), higher_is_better=True)
        hits += cmp["low"] <= 0.3 <= cmp["high"]
    assert abs(hits / 2000 - 0.95) < 0.02  # 4 standard errors


@pytest.mark.parametrize("n", range(3, 9))
def test_smallest_wilcoxon_p_is_scipys_for_all_differences_on_one_side(n):
    assert compare.min_wilcoxon_p(n) == \
        pytest.approx(scipy.stats.wilcoxon(np.arange(1.0, n + 1), method="exact").pvalue)


def test_two_seeds_say_first_that_they_are_too_few_and_give_no_verdict():
    two = compare.paired_comparison([0.173, 0.187], [0.1, 0.1], higher_is_better=False)
    text = compare.verdict(two, "A", "B", "fid", higher_is_better=False)
    assert text.startswith("Too few seeds for a verdict: 2 paired seeds cannot say whether A is better than B on fid.")
    assert "support" not in text and "contradict" not in text and "Run at least 3 seeds" in text
    one = compare.verdict(compare.paired_comparison([0.2], [0.1], False), "A", "B", "fid", False)
    assert one.startswith("Too few seeds") and "No interval can be computed" in one


def test_verdict_says_no_rank_test_with_three_seeds_and_reports_one_with_six():
    three = compare.paired_comparison([0.1, 0.2, 0.15], [0.3, 0.4, 0.35], higher_is_better=False)
    text = compare.verdict(three, "A", "B", "fid", higher_is_better=False)
    assert text.startswith("The data support the claim that A is better") and "2/2^3 = 0.25" in text
    assert "No rank test can reach p < 0.05" in text and "Wilcoxon signed-rank test: p =" not in text
    worse = compare.paired_comparison([0.3, 0.4, 0.35], [0.1, 0.2, 0.15], higher_is_better=False)
    assert compare.verdict(worse, "A", "B", "fid", False).startswith("The data contradict")
    mixed = compare.paired_comparison([0.1, 0.5, 0.3], [0.3, 0.2, 0.35], higher_is_better=False)
    assert compare.verdict(mixed, "A", "B", "fid", False).startswith("The data do not settle")
    six = compare.paired_comparison(np.zeros(6), np.arange(1.0, 7), higher_is_better=False)
    text = compare.verdict(six, "A", "B", "fid", higher_is_better=False)
    assert "No rank test" not in text and "Wilcoxon signed-rank test: p = 0.0312" in text


def test_spearman_against_the_closed_form_and_scipy():
    x, y = np.arange(8.0), np.array([2, 0, 1, 4, 3, 7, 5, 6], dtype=float)  # a permutation: no ties
    closed = 1 - 6 * np.sum((x - y) ** 2) / (8 * (8**2 - 1))
    assert compare.spearman(x, y) == pytest.approx(closed)
    ties = [1.0, 2.0, 2.0, 3.0, 5.0, 5.0], [0.3, 0.1, 0.2, 0.2, 0.9, 0.4]
    assert compare.spearman(*ties) == pytest.approx(scipy.stats.spearmanr(*ties).statistic)
    assert compare.spearman(np.exp(x), -x**3) == pytest.approx(-1.0)  # any monotone pair: ranks only


# ---- compare.md and the plots from run folders with known numbers ------------------------------------------

FINAL_ACC = {("disentangled", 0): 0.60, ("disentangled", 1): 0.70, ("disentangled", 2): 0.65,
             ("adanorm", 0): 0.50, ("adanorm", 1): 0.66, ("adanorm", 2): 0.55}
STEPS = [50, 100, 150, 200]


def write_run(folder, mode, seed):
    """A run folder as the trainers write it, and a quality.jsonl as demo_quality.py --write does. Accuracy rises
    as val_loss falls, over steps and across runs: their Spearman is exactly -1."""
    folder.mkdir(parents=True)
    cfg = {"seed": seed, "run_dir": str(folder), "resume": "latest", "conditioning": {"mode": mode},
           "objective": {"time_sampling": "logit_normal"},
           "train": {"batch_size": 64, "grad_accum": 1, "max_steps": 200}}
    (folder / "config.json").write_text(json.dumps(cfg))
    acc = FINAL_ACC[(mode, seed)]
    rows = []
    for i, step in enumerate(STEPS):
        rows.append({"step": step, "loss": 1.0 - 0.1 * i, "loss_smoothed": 1.0,
                     "images_per_s": 100.0 + seed + (mode == "adanorm") * 10,
                     "images_per_s_per_device": 100.0 + seed + (mode == "adanorm") * 10,
                     "peak_memory_gb": 1.0 + 0.1 * i,
                     "clip_share": 0.2 * (i % 2), "skipped_steps": 0, "loss_spikes": 1 if mode == "adanorm" else 0})
        rows.append({"step": step, "val_loss": 1.0 - acc * (i + 1) / len(STEPS)})
    rows.append({"step": 120, "event": "loss_spike", "loss": 3.0, "loss_smoothed": 1.0})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "quality.jsonl").write_text("".join(json.dumps({"step": s, "class_accuracy": acc * (i + 1) / len(STEPS)})
                                                  + "\n"
                                                  for i, s in enumerate(STEPS)))


@pytest.mark.slow
def test_compare_writes_every_section_and_plot_with_the_right_numbers(tmp_path):
    sweep = tmp_path / "sweep"
    runs = []
    for mode in ("disentangled", "adanorm"):
        for seed in range(3):
            write_run(sweep / f"conditioning.mode={mode},seed={seed}", mode, seed)
            runs.append({"run_dir": str(sweep / f"conditioning.mode={mode},seed={seed}")})
    (sweep / "sweep.json").write_text(json.dumps({"runs": runs}))

    path = compare.main([str(sweep)])
    md = path.read_text()
    assert path == sweep / "compare.md"
    for plot in ("evolution_val_loss", "evolution_class_accuracy", "sensitivity", "hypothesis",
                 "correlation", "methods"):
        assert (sweep / "compare" / f"{plot}.png").stat().st_size > 5000, plot
        assert f"](compare/{plot}.png)" in md
    for section in ("Quality metrics evolution", "Parameter sensitivity", "Hypothesis validation",
                    "Performance correlation", "Methodology comparison"):
        assert f"## {section}" in md
    assert "Swept: conditioning.mode." in md and "`class_accuracy` (higher is better)" in md
    assert "clip_share](" not in md and "| clip_share |" not in md  # a training statistic, not sample quality

    # Hypothesis: A = disentangled (the sweep's first arm), B = adanorm; d = (0.10, 0.04, 0.10).
    a = [FINAL_ACC[("disentangled", s)] for s in range(3)]
    b = [FINAL_ACC[("adanorm", s)] for s in range(3)]
    want = compare.paired_comparison(a, b, higher_is_better=True)
    assert want["p_better"] == pytest.approx(scipy.stats.t.cdf(0.08 / (np.std([0.1, 0.04, 0.1], ddof=1) / 3**0.5), 2))
    assert want["mean"] == pytest.approx(0.08)
    assert "**A = conditioning.mode=disentangled, B = conditioning.mode=adanorm**" in md
    assert (f"Mean difference {compare.fmt(want['mean'])}, 95% paired t-interval [{compare.fmt(want['low'])}, "
            f"{compare.fmt(want['high'])}], P(A better) = 0.97.") in md
    assert "The data do not settle whether conditioning.mode=disentangled is better" in md  # [-0.006, 0.166]
    assert "No rank test can reach p < 0.05 with 3 paired seeds" in md
    # Sensitivity: each arm's mean and t-interval over its seeds.
    mean, low, high = compare.t_interval(a)
    assert f"| conditioning.mode=disentangled | 3 | {compare.fmt(mean)} [{compare.fmt(low)}, {compare.fmt(high)}] |" \
        in md
    # Correlation: accuracy rises exactly as val_loss falls, in every run: rho = -1 over all 24 points.
    assert "| class_accuracy | 24 | 6 | -1 | -1 |" in md
    # Methodology: images/s 100 + seed (+10 for adanorm) -> arm means 101 and 111; spikes 0 and 1.
    row = next(line for line in md.splitlines() if line.startswith("| conditioning.mode=adanorm | 111 |"))
    assert row.split(" | ")[3] == "1"  # loss spikes (the trainer's cumulative count)
    assert "| conditioning.mode=disentangled | 101 |" in md


def test_compare_md_with_two_seeds_says_so_before_the_numbers_and_gives_no_verdict(tmp_path, unrendered_figures):
    for mode in ("disentangled", "adanorm"):
        for seed in range(2):
            write_run(tmp_path / f"{mode}{seed}", mode, seed)
    md = compare.main([str(p) for p in sorted(tmp_path.iterdir())] + ["--out", str(tmp_path / "out")]).read_text()
    section = md[md.index("## Hypothesis validation"):md.index("## Performance correlation")]
    assert section.index("Too few seeds for a verdict: 2 paired seeds") < section.index("| seed | A | B | A - B |")
    assert "The data" not in section and "95% paired t-interval [" in section


def test_compare_refuses_a_folder_that_is_not_a_run_and_a_metric_not_logged(tmp_path):
    with pytest.raises(SystemExit, match="neither a sweep folder"):
        compare.main([str(tmp_path)])
    write_run(tmp_path / "r0", "adanorm", 0)
    with pytest.raises(SystemExit, match="metric 'fid_clean_1k' is not logged"):
        compare.main([str(tmp_path / "r0"), "--metric", "fid_clean_1k"])


def test_each_metric_is_read_in_its_own_direction():
    """Scores where higher is better (accuracy, CLIP score, the control ablation's sharpness ratio: the size control
    changes sharpness) against losses and distances."""
    for metric in ("class_accuracy", "class_accuracy_largest", "clip_score",
                   "precision_inception_1k", "sharpness_ratio"):
        assert compare.HIGHER_IS_BETTER.search(metric), metric
    for metric in ("fid_clean_1k", "fd_classifier", "size_drift", "val_loss", "kid_clean_1k"):
        assert not compare.HIGHER_IS_BETTER.search(metric), metric
