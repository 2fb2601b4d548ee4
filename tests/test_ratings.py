"""training/evaluation/ratings.py: win rates, Bradley-Terry, star ratings and the vote count, against closed forms, an
independent likelihood maximisation (scipy) and the exact binomial distribution."""
import json
import math

import numpy as np
import pytest
import scipy.optimize
import scipy.stats

from training.evaluation import ratings


def pair_votes(results, a="A", b="B"):
    """results: a string of 'a' (a won), 'b', 't' (tie), 's' (skip); sides alternate left and right."""
    choice = {"t": "tie", "s": "skip"}
    out = []
    for i, r in enumerate(results):
        left, right = (a, b) if i % 2 == 0 else (b, a)
        c = choice.get(r) or ("left" if (r == "a") == (left == a) else "right")
        out.append({"id": str(i), "kind": "pair", "index": i, "seed": 0, "left": left, "right": right, "choice": c})
    return out


def test_win_rate_counts_ties_as_half_and_its_interval_is_the_binomial_one():
    votes = pair_votes("a" * 6 + "b" * 2 + "tt" + "s")
    r = ratings.win_rate(votes, "A", "B")
    assert (r["wins"], r["losses"], r["ties"], r["skips"], r["n"]) == (6, 2, 2, 1, 10)
    assert r["rate"] == pytest.approx(0.7)
    assert ratings.win_rate(votes, "B", "A")["rate"] == pytest.approx(0.3)
    assert (r["low"], r["high"]) == pytest.approx(ratings.wilson_interval(7, 10))  # ties: half a success each
    # Large n: the Wilson interval approaches p +- 1.96 sqrt(p (1 - p) / n).
    big = ratings.win_rate(pair_votes("a" * 240 + "b" * 160), "A", "B")
    half = 1.96 * math.sqrt(0.6 * 0.4 / 400)
    assert big["rate"] == 0.6
    assert big["low"] == pytest.approx(0.6 - half, abs=0.002) and big["high"] == pytest.approx(0.6 + half, abs=0.002)
    assert ratings.win_rate([], "A", "B")["rate"] is None


@pytest.mark.parametrize("wins,n", [(3, 3), (0, 3), (1, 1), (2, 5), (7, 9), (30, 50), (240, 400)])
def test_the_win_rate_interval_is_wilsons_and_three_unanimous_votes_are_too_few_to_tell(wins, n):
    """scipy's binomtest(...).proportion_ci(method="wilson") is the oracle. Three unanimous votes used to read
    "win rate 1.000 [95% CI 1.000, 1.000]" (a bootstrap of three equal votes); Wilson gives [0.44, 1], which
    includes 0.5, and the summary says the votes are too few to tell."""
    r = ratings.win_rate(pair_votes("a" * wins + "b" * (n - wins)), "A", "B")
    ci = scipy.stats.binomtest(wins, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert (r["low"], r["high"]) == pytest.approx((ci.low, ci.high), abs=1e-9)
    if n == 3 and wins == 3:
        assert r["low"] == pytest.approx(0.4385, abs=1e-4) and r["high"] == 1.0
        text = "\n".join(ratings.summary_lines(pair_votes("aaa")))
        assert "[95% CI 0.439, 1.000]" in text and "too few votes to tell" in text


def test_the_mean_rating_interval_is_students_t_and_equal_ratings_give_none():
    """scipy's one-sample t-test interval is the oracle; fewer than 2 ratings, or ratings all equal (3 fives: a
    bootstrap said [5.00, 5.00]), give no interval, and the summary says they are too few to tell."""
    stars = [4, 3, 3, 4, 2, 4, 3, 5, 3, 4]
    ci = scipy.stats.ttest_1samp(stars, 3.0).confidence_interval(0.95)
    assert 1 < ci.low and ci.high < 5 and ratings.mean_interval(np.array(stars, float)) == \
        pytest.approx((ci.low, ci.high), abs=1e-9)
    assert ratings.mean_interval(np.array([5.0, 4.0]))[1] == 5.0  # kept within the scale (t_1 is wide)
    votes = [{"id": str(i), "kind": "rating", "index": i, "seed": 0, "condition": "c", "side": "run/x", "choice": 5}
             for i in range(3)]
    s = ratings.star_summary(votes)["run/x"]
    assert (s["count"], s["mean"], s["low"], s["high"]) == (3, 5.0, None, None)
    assert "too few ratings to tell" in "\n".join(ratings.summary_lines(votes))


def test_bradley_terry_two_sides_has_the_closed_form():
    # Two sides: the MLE odds are W_A / W_B; with the one virtual tie of the prior, (W_A + 1/2) / (W_B + 1/2).
    outcomes = ratings.pair_outcomes(pair_votes("a" * 30 + "b" * 10 + "t" * 4))
    scores = ratings.bradley_terry(outcomes, ["A", "B"])
    assert scores["A"] - scores["B"] == pytest.approx(400 * math.log10((32 + 0.5) / (12 + 0.5)), abs=1e-6)
    assert (scores["A"] + scores["B"]) / 2 == pytest.approx(1000)


def test_bradley_terry_maximises_the_likelihood_scipy_finds():
    rng = np.random.default_rng(0)
    sides, true = ["A", "B", "C", "D"], np.array([0.0, 0.6, -0.4, 1.2])  # natural-log strengths
    outcomes = []
    for _ in range(600):
        i, j = rng.choice(4, 2, replace=False)
        p = 1 / (1 + math.exp(true[j] - true[i]))
        u = rng.random()
        outcomes.append((sides[i], sides[j], 1.0) if u < 0.9 * p else (sides[j], sides[i], 1.0) if u < 0.9 else
                        (sides[i], sides[j], 0.5))  # 10% ties

    pairs = [(sides[a], sides[b], 0.5) for a in range(4) for b in range(a + 1, 4)] + outcomes  # + virtual ties
    w, lose, score = (np.array(c) for c in zip(*[(sides.index(a), sides.index(b), s) for a, b, s in pairs]))

    def nll(beta):  # the same model and prior as a likelihood: -sum s log P(w > l) + (1 - s) log P(l > w)
        d = beta[w] - beta[lose]
        return np.sum(score * np.logaddexp(0, -d) + (1 - score) * np.logaddexp(0, d))
    best = scipy.optimize.minimize(nll, np.zeros(4), method="BFGS", options={"gtol": 1e-9}).x
    best -= best.mean()
    ours = ratings.bradley_terry(outcomes, sides)
    elo = np.array([ours[s] for s in sides])
    np.testing.assert_allclose((elo - 1000) * math.log(10) / 400, best, atol=1e-5)
    # And the bootstrap intervals cover the truth (centred), at these 600 votes.
    votes = [{"kind": "pair", "left": w, "right": l_, "choice": "tie" if s == 0.5 else "left"} for w, l_, s in outcomes]
    intervals = ratings.bradley_terry_intervals(votes, sides, rounds=200)
    truth = 1000 + 400 / math.log(10) * (true - true.mean())
    for side, t in zip(sides, truth):
        score, low, high = intervals[side]
        assert low < score < high and low - 30 < t < high + 30


def test_190_votes_tell_60_from_50_percent():
    n = ratings.votes_needed(0.6)
    z_a, z_b = 1.959964, 0.841621
    assert n == math.ceil(((z_a * 0.5 + z_b * math.sqrt(0.24)) / 0.1) ** 2) == 194
    # Exactly, with the binomial: the two-sided 5% test at n = 194 rejects 0.5 with probability about 0.8
    # when the true rate is 0.6 (0.76: the exact test is conservative, its real level is below 5%).
    lo, hi = scipy.stats.binom.ppf(0.025, n, 0.5), scipy.stats.binom.isf(0.025, n, 0.5)
    power = scipy.stats.binom.cdf(lo - 1, n, 0.6) + scipy.stats.binom.sf(hi, n, 0.6)
    assert 0.75 < power < 0.85
    assert ratings.votes_needed(0.5) == math.inf and ratings.votes_needed(0.7) < 60


@pytest.mark.slow  # 2-3 s: the fast tier stays under 60 s
def test_star_summary_and_summary_lines(tmp_path):
    votes = [{"id": str(i), "kind": "rating", "index": i % 4, "seed": 0, "condition": f"class {i % 4}",
              "side": "run/x", "choice": c} for i, c in enumerate([5, 4, 1, 3, 5, 4, 2, "skip"])]
    s = ratings.star_summary(votes)["run/x"]
    assert s["count"] == 7 and s["mean"] == pytest.approx(24 / 7) and s["histogram"] == {1: 1, 2: 1, 3: 1, 4: 2, 5: 2}
    assert s["worst"][0] == (1.5, 2, 0, "class 2", 2)  # sample 2: ratings 1 and 2
    assert s["low"] < s["mean"] < s["high"]
    (tmp_path / ratings.VOTES_FILE).write_text("".join(json.dumps(v) + "\n" for v in votes + votes[:2])
                                               + '{"id": "cut sho')  # a duplicate and a cut-short line
    assert len(ratings.read_votes([tmp_path])) == 8
    three = pair_votes("ab" * 5, "A", "B") + pair_votes("a" * 8, "A", "C") + pair_votes("a" * 8, "B", "C")
    for v, i in zip(three, range(100)):
        v["id"] = str(i)
    text = "\n".join(ratings.summary_lines(three))
    assert "Bradley-Terry" in text and text.endswith("  C")  # C lost every vote: last
    assert "includes 0.5" in "\n".join(ratings.summary_lines(pair_votes("aab")))
