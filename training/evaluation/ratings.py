"""Human ratings: the vote file tools/rate.py appends to in each run folder, and what the votes say: a win rate
with its Wilson 95% interval for two sides, Bradley-Terry scores with bootstrap intervals for more, the mean of
1-5 ratings with its Student-t interval, and the worst-rated samples; when the votes are too few to tell, the
summary says so. report.py shows them for a run that has votes.

A vote is one JSON line of <run>/ratings.jsonl (every run it involves holds a copy; `id` deduplicates):
    {"id", "time", "kind": "pair", "index": i, "seed": base seed, "condition": "red circle",
     "left": label, "right": label, "left_dir", "right_dir", "choice": "left" | "right" | "tie" | "skip"}
    {"id", "time", "kind": "rating", "index", "seed", "condition", "side": label, "dir", "choice": 1..5 | "skip"}
A side's label is "<run folder name>/<eval folder name>" (the model and every sampling setting); sample i has
eval_fid.py's noise seed_for(seed, 0, i) and condition i % num_classes (or prompt i), the same on every side.
"""
import json
import math
import statistics
from pathlib import Path

import numpy as np

VOTES_FILE = "ratings.jsonl"
BOOTSTRAP_ROUNDS = 1000


def read_votes(paths):
    """The votes of these vote files or run folders, each once (by id), in file order; a line that does not
    parse (cut short by a crash) is skipped."""
    votes, seen = [], set()
    for path in map(Path, paths):
        path = path / VOTES_FILE if path.is_dir() else path
        for line in path.read_text().splitlines() if path.is_file() else []:
            try:
                vote = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(vote, dict) and vote.get("id") not in seen:
                seen.add(vote.get("id"))
                votes.append(vote)
    return votes


def pair_outcomes(votes):
    """[(winner_label, loser_label, score)] of the non-skipped pair votes: score 1 for a win, 0.5 for a tie
    (a tie counts as half a win for each side, as Chatbot Arena's Bradley-Terry fit counts it)."""
    out = []
    for v in votes:
        if v.get("kind") == "pair" and v.get("choice") in ("left", "right", "tie"):
            first, second = (v["left"], v["right"]) if v["choice"] != "right" else (v["right"], v["left"])
            out.append((first, second, 0.5 if v["choice"] == "tie" else 1.0))
    return out


def percentile_interval(samples):
    return float(np.percentile(samples, 2.5)), float(np.percentile(samples, 97.5))


def wilson_interval(successes, n, confidence=0.95):
    """The Wilson score interval of a binomial proportion (Wilson 1927): the p with |p_hat - p| <= z sqrt(p (1 - p)
    / n). Unlike p_hat +- z sqrt(p_hat (1 - p_hat) / n) or a bootstrap of the votes, which give 3 unanimous votes the
    interval [1, 1], its coverage stays near 95% at small n (Brown, Cai & DasGupta 2001): [0.44, 1] for 3 of 3."""
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    p, shrink = successes / n, 1 + z * z / n
    centre, half = (p + z * z / (2 * n)) / shrink, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / shrink
    return max(0.0, centre - half), min(1.0, centre + half)


def win_rate(votes, a, b):
    """a's win rate against b, ties as half wins, with its Wilson 95% interval over the decided votes (a tie
    counted as half a success; its true variance is smaller, so the interval is if anything conservative);
    counts of wins, losses, ties and skips."""
    between = [v for v in votes if v.get("kind") == "pair" and {v.get("left"), v.get("right")} == {a, b}]
    won = np.array([0.5 if s == 0.5 else 1.0 if w == a else 0.0 for w, _, s in pair_outcomes(between)])
    counts = {"wins": int((won == 1).sum()), "losses": int((won == 0).sum()), "ties": int((won == 0.5).sum()),
              "skips": sum(v.get("choice") == "skip" for v in between), "n": len(won)}
    if not len(won):
        return {**counts, "rate": None, "low": None, "high": None}
    return {**counts, "rate": float(won.mean()), **dict(zip(("low", "high"), wilson_interval(won.sum(), len(won))))}


def bradley_terry(outcomes, sides, prior_ties=1.0):
    """Bradley-Terry strengths P(i beats j) = p_i / (p_i + p_j) (Bradley & Terry 1952), fitted by maximum
    likelihood with Hunter's (2004) MM iteration p_i <- W_i / sum_j n_ij / (p_i + p_j), returned on the Elo scale
    1000 + 400 log10(p_i) (geometric mean 1000: 400 points = 10:1 odds). Ties are half wins. `prior_ties`
    virtual ties between every pair keep a side that never won (or never lost) finite; with n real votes they
    move a score by O(1/n)."""
    index = {s: i for i, s in enumerate(sides)}
    k = len(sides)
    wins = np.full(k, prior_ties * 0.5 * (k - 1))
    games = np.full((k, k), prior_ties) - np.diag(np.full(k, prior_ties))
    for winner, loser, score in outcomes:
        i, j = index[winner], index[loser]
        wins[i] += score
        wins[j] += 1 - score
        games[i, j] += 1
        games[j, i] += 1
    p = np.ones(k)
    for _ in range(10_000):
        new = wins / (games / (p[:, None] + p[None, :])).sum(1)
        new /= np.exp(np.log(new).mean())
        if np.max(np.abs(new - p)) < 1e-12:
            break
        p = new
    return {s: 1000 + 400 * math.log10(p[i]) for s, i in index.items()}


def bradley_terry_intervals(votes, sides=None, rounds=BOOTSTRAP_ROUNDS, seed=0):
    """{side: (score, low, high)}: the fit on all votes and the 2.5/97.5 percentiles of fits on bootstrap
    resamples of the votes (FastChat's get_bootstrap_result)."""
    outcomes = pair_outcomes(votes)
    sides = sides or sorted({s for w, l, _ in outcomes for s in (w, l)})
    fit = bradley_terry(outcomes, sides)
    rng = np.random.default_rng(seed)
    boot = [bradley_terry([outcomes[i] for i in rng.integers(0, len(outcomes), len(outcomes))], sides)
            for _ in range(rounds if outcomes else 0)]
    return {s: (fit[s], *percentile_interval([b[s] for b in boot])) if boot else (fit[s], None, None)
            for s in sides}


def votes_needed(rate, null=0.5, alpha=0.05, power=0.8):
    """Non-tie votes for a two-sided test at level alpha to tell `rate` from `null` with this power (the normal
    approximation to the binomial): n = ((z_{1-alpha/2} sqrt(p0 q0) + z_power sqrt(p q)) / (p - p0))^2."""
    if rate == null:
        return math.inf
    z_a, z_b = statistics.NormalDist().inv_cdf(1 - alpha / 2), statistics.NormalDist().inv_cdf(power)
    return math.ceil(((z_a * math.sqrt(null * (1 - null)) + z_b * math.sqrt(rate * (1 - rate))) / (rate - null)) ** 2)


def mean_interval(values, confidence=0.95):
    """The Student-t interval of a mean, mean +- t_{n-1} s / sqrt(n), kept within the 1-5 scale; (None, None)
    when it cannot say anything: fewer than 2 ratings, or all of them equal (s = 0 would claim a width of 0,
    as a bootstrap of the ratings does)."""
    from scipy import stats

    if len(values) < 2 or np.ptp(values) == 0:
        return None, None
    half = stats.t.ppf(0.5 + confidence / 2, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(len(values))
    return max(1.0, float(np.mean(values) - half)), min(5.0, float(np.mean(values) + half))


def star_summary(votes, worst=10):
    """Per side: {count, mean, low, high, histogram, worst: [(mean rating, index, seed, condition, n)]}."""
    out = {}
    for side in sorted({v["side"] for v in votes if v.get("kind") == "rating"}):
        mine = [v for v in votes if v.get("kind") == "rating" and v["side"] == side and v.get("choice") in range(1, 6)]
        stars = np.array([v["choice"] for v in mine], dtype=float)
        per_sample = {}
        for v in mine:
            per_sample.setdefault((v["index"], v.get("seed"), v.get("condition")), []).append(v["choice"])
        ranked = sorted((float(np.mean(r)), *key, len(r)) for key, r in per_sample.items())
        out[side] = {"count": len(stars), "mean": float(stars.mean()) if len(stars) else None,
                     **dict(zip(("low", "high"), mean_interval(stars))),
                     "histogram": {s: int((stars == s).sum()) for s in range(1, 6)}, "worst": ranked[:worst]}
    return out


def summary_lines(votes):
    """What the votes say, in plain lines: win rates (two sides), Bradley-Terry scores (more), star ratings."""
    lines, sides = [], sorted({s for v in votes if v.get("kind") == "pair" for s in (v["left"], v["right"])})
    for a, b in ([sides] if len(sides) == 2 else []):
        r = win_rate(votes, a, b)
        if r["rate"] is not None and r["rate"] < 0.5:  # the leading side first
            a, b, r = b, a, win_rate(votes, b, a)
        if r["rate"] is None:
            lines.append(f"{a} vs {b}: no decided votes yet ({r['skips']} skipped)")
            continue
        lines.append(f"{a} vs {b}: win rate {r['rate']:.3f} [95% CI {r['low']:.3f}, {r['high']:.3f}] over {r['n']} "
                     f"votes ({r['wins']} wins, {r['losses']} losses, {r['ties']} ties as half wins; "
                     f"{r['skips']} skipped)")
        if r["low"] <= 0.5 <= r["high"]:
            need = votes_needed(r["rate"]) if r["rate"] != 0.5 else math.inf
            lines.append(f"  too few votes to tell the two apart (the interval includes 0.5): a true rate of "
                         f"{r['rate']:.2f} needs about {need} non-tie votes to be told from 0.5 (95%, power 0.8); "
                         f"0.60 needs {votes_needed(0.6)}")
    if len(sides) > 2:
        lines.append(f"Bradley-Terry scores (Elo scale, ties as half wins) over {len(pair_outcomes(votes))} votes:")
        scores = bradley_terry_intervals(votes, sides)
        for side, (score, low, high) in sorted(scores.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"  {score:7.1f}  [95% CI {low:.1f}, {high:.1f}]  {side}")
    for side, s in star_summary(votes).items():
        if not s["count"]:
            continue
        hist = ", ".join(f"{k}: {n}" for k, n in s["histogram"].items())
        interval = (f"[95% CI {s['low']:.2f}, {s['high']:.2f}]" if s["low"] is not None else
                    "(too few ratings to tell: no interval from fewer than 2, or from ratings all equal)")
        lines.append(f"{side}: mean rating {s['mean']:.2f} {interval} over {s['count']} ratings ({hist})")
        lines += [f"  worst: sample {i} (seed {seed}), {cond!r}: {mean:.1f} ({n} rating{'s' * (n > 1)})"
                  for mean, i, seed, cond, n in s["worst"][:5]]
    return lines or ["no votes yet"]
