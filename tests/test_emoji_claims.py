"""benchmarks/emoji_claims.py (issue 70; docs/benchmarks/emoji_claims.md): the arms differ only where each claim says,
the mixed-size data keeps every row and column at a recorded native side, the padding probe's formulas, and the
pre-registered verdicts on synthetic runs (a planted effect recovered, a null one "cannot tell")."""
import argparse
import json

import numpy as np
import pytest
import torch

import train_flow_matching as fm
from benchmarks import emoji_claims as claims
from training.config import config
from training.data import emoji


def flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


def resolved(arm, seed=0):
    args = argparse.Namespace(out="runs/emoji_claims")
    cfg = config.load_config(fm.DEFAULTS, ["--config", str(claims.recipe_campaign.RECIPE), f"--seed={seed}",
                                           *claims.arm_args(args, arm)])
    assert not config.schema_problems(fm.CONFIG, cfg, cfg.origin) and not config.combination_problems(cfg)
    return flat(json.loads(json.dumps(cfg)))


def differences(a, b):
    return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}


def test_the_arms_differ_only_where_each_claim_says():
    """Claim 1: adanorm against disentangled differ in conditioning.mode alone; claim 2: disentangled against
    zero_padding in the padding alone; every arm has the size control and reads the mixed-size data."""
    arms = {arm: resolved(arm) for arm in claims.ARMS}
    assert differences(arms["adanorm"], arms["disentangled"]) == {"conditioning.mode"}
    assert differences(arms["disentangled"], arms["zero_padding"]) == {"conditioning.replicate_padding",
                                                                      "conditioning.zero_padding"}
    zero = arms["zero_padding"]
    assert zero["conditioning.zero_padding"] and not zero["conditioning.replicate_padding"]
    assert arms["disentangled"]["conditioning.replicate_padding"]  # the paper's padding in the paper's arm
    for cfg in arms.values():
        assert cfg["conditioning.controls"] == ["size"] and cfg["data.source"].endswith("data/mixed_sizes")
    assert differences(resolved("adanorm", 0), resolved("adanorm", 3)) == {"seed"}


@pytest.mark.slow
def test_the_mixed_size_data_keeps_every_row_at_its_recorded_side(tmp_path, monkeypatch):
    from test_emoji import write_packages

    monkeypatch.setattr(emoji, "PINNED", write_packages(tmp_path / "emoji"))
    args = argparse.Namespace(out=str(tmp_path / "out"), source=f"emoji:{tmp_path / 'emoji'}")
    claims.data_stage(args)
    sides = json.loads((claims.data_folder(args) / "sides.json").read_text())
    import datasets

    for split in ("train", "validation", "test"):
        original = emoji.load(split, tmp_path / "emoji")
        made = datasets.load_dataset("parquet", split="train", data_files=str(
            claims.data_folder(args) / f"{split}-00000-of-00001.parquet"))
        assert made.features == original.features and len(made) == len(original) == sides[split]["images"]
        for row, before, side in zip(made, original, sides[split]["sides"]):
            assert claims.SIDES[0] <= side <= claims.SIDES[1] and row["image"].size == (side, side)
            assert {k: v for k, v in row.items() if k != "image"} == {k: v for k, v in before.items() if k != "image"}
            small = np.asarray(before["image"].convert("RGB").resize((side, side), 4), dtype=float)  # 4: box
            assert np.abs(np.asarray(row["image"], dtype=float) - small).max() <= 1
    assert len(set(sides["train"]["sides"])) > 5  # drawn, not one size
    again = argparse.Namespace(out=str(tmp_path / "again"), source=args.source)
    claims.data_stage(again)
    assert json.loads((claims.data_folder(again) / "sides.json").read_text()) == sides  # seeded
    from training.sharing import public  # every run's card on this folder carries the images' terms

    terms = public.licence_lines(str(claims.data_folder(args).resolve()))[2:-1]
    assert terms[:2] == [f"- {t}" for t in emoji.LICENCES[:2]] and len(terms) == 3
    assert terms[2].startswith(f"- {emoji.LICENCES[2]}") and terms[2].endswith("box-downsampled to a side drawn in "
                                                                               "16-64 px")


def test_the_guidance_gap_is_the_conditional_change_over_the_unconditional():
    """A model whose conditional output is 3x its unconditional one: the gap is |3m - m| / |m| = 2 at every level."""
    def model(x, t, cond):
        return (x + 1.0) * torch.where(cond["drop"], 1.0, 3.0)[:, None, None, None]

    x0 = torch.randn(4, 2, 3, 3)
    gap = claims.guidance_gap(model, x0, {"drop": torch.zeros(4, dtype=torch.bool)})
    torch.testing.assert_close(gap, torch.full((4,), 2.0))


def test_scores_by_caption_length_split_at_the_median():
    class Words:  # a tokenizer that counts words, plus start and end
        def __call__(self, captions, max_length, **kwargs):
            mask = torch.zeros(len(captions), max_length)
            for i, c in enumerate(captions):
                mask[i, :min(len(c.split()) + 2, max_length)] = 1
            return argparse.Namespace(input_ids=mask.long(), attention_mask=mask)

    rows = [{"caption": "a b", "clip_score": 10.0, "caption_rank": 1}, {"caption": "a b c", "clip_score": 20.0,
             "caption_rank": 9}, {"caption": "a b c d e", "clip_score": 30.0, "caption_rank": 5},
            {"caption": "a", "clip_score": 40.0, "caption_rank": 6}]
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "per_sample.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows))
        out = claims.by_length(path, Words(), {"encoders": {"max_tokens": 24}}, median=5)
    assert out == {"clip_score_short": 70 / 3, "top5_short": 1 / 3, "clip_score_long": 30.0, "top5_long": 1.0}


def fake_runs(out, fd, sharpness=1.4, seeds=claims.SEEDS):
    """Scored runs as the score stage leaves them: fd[arm] gives FD on all test captions per seed."""
    for arm, values in fd.items():
        for seed, value in zip(seeds, values):
            run = out / f"{arm}_s{seed}"
            (run / "eval" / "test").mkdir(parents=True)
            metrics = {"fd_clip_774": value, "fd_clip_364_recombination": value + 1, "fd_clip_410_new": value + 2,
                       "clip_score_774": 70.0, "retrieval_top5_774": 0.6, "retrieval_top5_364_recombination": 0.7,
                       "class_accuracy_774": 0.8}
            (run / "eval" / "test" / "report.json").write_text(json.dumps({"metrics": metrics}))
            (run / "checks.json").write_text(json.dumps({name: 1.0 for name in claims.CHECKS} | {
                "sharpness_ratio": sharpness + 0.01 * seed}))
            (run / "cpu_seconds.json").write_text(json.dumps({"train": 1500.0 + seed}))


@pytest.mark.parametrize("fd,conditioning,padding", [
    # disentangled 15% below adanorm, zero padding 1 above disentangled: both effects recovered
    ({"adanorm": [10.0, 11, 10.5, 9.8, 10.2], "disentangled": [8.5, 9.3, 8.9, 8.4, 8.6],
      "zero_padding": [9.5, 10.4, 9.8, 9.5, 9.6]}, "supports: disentangled conditioning lowers FD", "supports"),
    # no effect anywhere: noise around the same FD
    ({"adanorm": [10.0, 11, 10.5, 9.8, 10.2], "disentangled": [11.5, 9.5, 12.0, 8.6, 10.0],
      "zero_padding": [11.0, 10.1, 11.6, 8.9, 9.9]}, "cannot tell: the interval", "cannot tell"),
    # disentangled worse, replicate padding worse
    ({"adanorm": [10.0, 11, 10.5, 9.8, 10.2], "disentangled": [11.0, 12.1, 11.4, 10.9, 11.1],
      "zero_padding": [10.0, 11, 10.5, 9.8, 10.2]}, "contradicts", "contradicts")])
def test_the_verdicts_recover_a_planted_effect_and_call_a_null_one_cannot_tell(tmp_path, fd, conditioning, padding):
    fake_runs(tmp_path, fd)
    said = claims.verdicts(claims.scores(tmp_path))
    assert said["conditioning"].startswith(conditioning) and said["padding"].startswith(padding)
    claims.report(argparse.Namespace(out=str(tmp_path)))
    text = (tmp_path / "report.md").read_text()
    assert f"- conditioning: {said['conditioning']}" in text and f"- padding: {said['padding']}" in text
    assert "| disentangled - zero_padding | fd_clip |" in text and "(5 seeds)" in text


def test_an_unlearnt_size_control_or_one_seed_settles_nothing(tmp_path):
    fd = {"adanorm": [10.0, 11, 10.5], "disentangled": [8.5, 9.3, 8.9], "zero_padding": [9.5, 10.4, 9.8]}
    fake_runs(tmp_path / "flat", fd, sharpness=0.95)
    said = claims.verdicts(claims.scores(tmp_path / "flat"))
    assert said["conditioning"].startswith("cannot tell: an arm's sharpness ratio interval reaches 1")
    assert said["padding"].startswith("supports")  # the padding's rule needs no size control
    fake_runs(tmp_path / "one", fd, seeds=(0,))
    said = claims.verdicts(claims.scores(tmp_path / "one"))
    assert said == {"conditioning": "not settled: 1 seed(s) of both arms",
                    "padding": "not settled: 1 seed(s) of both arms"}
