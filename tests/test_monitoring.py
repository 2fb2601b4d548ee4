"""Monitoring (issue 8): gradient norms and update ratios per layer group, vanishing / exploding flags, loss
spikes, clipping share, LR schedules and the scaling rule, and the run report at the end of a run."""
import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import common
from training.config import config
from training.model.mmdit import build_denoiser, load_exported
from training.run.monitor import find_spikes, gradient_flags, group_grad_norms, group_update_ratios, layer_groups
import train_ddpm as ddpm
import train_flow_matching as fm
from conftest import tiny_run_args

TINY_MODEL = ["--model.num_layers=2", "--model.num_attention_heads=2", "--model.attention_head_dim=16"]


def rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def tiny_denoiser():
    cfg = config.load_config(fm.DEFAULTS, ["--conditioning.controls", '["size"]', "--data.num_classes=9", *TINY_MODEL])
    return build_denoiser(cfg, 3, 8)


def test_layer_groups_cover_every_parameter_once_and_name_the_pipeline_stages():
    model = tiny_denoiser()
    groups = layer_groups(model)
    assert list(groups) == ["patch_embed", "conditioning", "block_00", "block_01", "final_layer"]
    assert sorted(id(p) for ps in groups.values() for p in ps) == sorted(id(p) for p in model.parameters())
    assert any(p is model.conditioner.control_mlp["size"][0].weight for p in groups["conditioning"])
    assert groups["patch_embed"] == list(model.transformer.pos_embed.parameters())


@pytest.mark.parametrize("clip", [1e-3, 1e6])  # clipping acting and not acting
def test_group_grad_norms_add_up_in_squares_to_the_total_norm(clip):
    torch.manual_seed(0)
    model = tiny_denoiser()
    x = torch.randn(4, 3, 8, 8)
    cond = {"label": torch.tensor([0, 1, 2, 3]), "drop": torch.zeros(4, dtype=torch.bool),
            "orig_hw": torch.tensor([[8, 8]] * 4)}
    model(x, torch.full((4,), 500.0), cond).pow(2).mean().backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # pre-clip total; grads now clipped
    norms = group_grad_norms(layer_groups(model), total, clip)
    assert math.sqrt(sum(v ** 2 for v in norms.values())) == pytest.approx(float(total), rel=1e-5)
    assert all(v > 0 for v in norms.values())


def test_update_ratio_is_the_relative_weight_change():
    model = tiny_denoiser()
    groups = layer_groups(model)
    before = {g: [p.detach().clone() for p in ps] for g, ps in groups.items()}
    with torch.no_grad():
        for p in groups["block_01"]:
            p.mul_(1.01)  # a 1% step in one group, nothing elsewhere
    ratios = group_update_ratios(groups, before)
    assert ratios["block_01"] == pytest.approx(0.01, rel=1e-4)
    assert all(ratios[g] == 0 for g in ratios if g != "block_01")


def test_gradient_flags_name_vanishing_and_exploding_groups():
    norms = {"patch_embed": 1.0, "block_00": 2.0, "block_01": 1e-5, "block_02": 3e3, "final_layer": 1.5,
             "conditioning": float("nan")}
    assert gradient_flags(norms, 100.0) == [("block_01", "grad_vanishing"), ("block_02", "grad_exploding"),
                                                   ("conditioning", "grad_exploding")]
    assert gradient_flags({"a": 1.0, "b": 50.0}, 100.0) == []


def test_loss_spikes_are_found_at_their_step_and_chunking_does_not_matter():
    gen = torch.Generator().manual_seed(0)
    losses = (1.0 + 0.01 * torch.randn(400, generator=gen)).tolist()
    losses[250], losses[320] = 1.5, 1.08  # 50 and 8 standard deviations above
    decreasing = [2.0 * 0.99 ** i for i in range(400)]  # fast early training: never a spike
    assert find_spikes(decreasing, {"mean": 0.0, "var": 0.0, "n": 0}, 6.0) == []
    state = {"mean": 0.0, "var": 0.0, "n": 0}
    spikes = find_spikes(losses, state, 6.0)
    assert [i for i, _ in spikes] == [250, 320] and spikes[0][1] == pytest.approx(1.0, abs=0.01)
    chunked, offset = {"mean": 0.0, "var": 0.0, "n": 0}, 0
    found = []
    for chunk in (losses[:10], losses[10:255], losses[255:400]):  # as the trainer calls it, once per log
        found += [offset + i for i, _ in find_spikes(chunk, chunked, 6.0)]
        offset += len(chunk)
    assert found == [250, 320] and chunked == state
    assert state["mean"] == pytest.approx(1.0, abs=0.02)  # the smoothed loss


def test_lr_schedules_and_the_scaling_rule():
    assert [common.lr_at(s, 1.0, 10, "constant", 100) for s in (0, 9, 50, 99)] == [0.1, 1.0, 1.0, 1.0]
    cos = [common.lr_at(s, 1.0, 10, "cosine", 110) for s in (9, 10, 60, 110)]
    assert cos == pytest.approx([1.0, 1.0, 0.5, 0.0])  # 0.5 (1 + cos(pi p)) after warm-up, p = (s - 10) / 100
    lin = [common.lr_at(s, 1.0, 10, "linear", 110) for s in (0, 10, 35, 110)]
    assert lin == pytest.approx([0.1, 1.0, 0.75, 0.0])
    assert common.lr_at(200, 1.0, 10, "cosine", 110) == 0.0
    with pytest.raises(ValueError, match="train.lr_schedule"):
        common.lr_at(0, 1.0, 0, "step", 10)
    tr = config.load_config(fm.DEFAULTS, ["--train.lr=1e-4", "--train.lr_scaling=sqrt"]).train
    scale, line = common.lr_scale(tr, 512)
    assert scale == pytest.approx(0.5) and "lr 5e-05 = 0.0001 x (512 / 2048)^0.5 (sqrt scaling rule)" in line
    tr["lr_scaling"] = "linear"
    assert common.lr_scale(tr, 4096)[0] == pytest.approx(2)
    tr["lr_scaling"] = "none"
    assert common.lr_scale(tr, 64)[0] == 1


@pytest.mark.slow
@pytest.mark.parametrize("trainer", [fm, ddpm])
def test_a_run_logs_gradient_analysis_clipping_and_writes_its_report(trainer, tmp_path, capsys):
    run = trainer.main(tiny_run_args(tmp_path, "run", steps=6) + TINY_MODEL + [
        "--log.grad_every=3", "--train.grad_clip=1e-3", "--train.lr=1e-3", "--train.lr_schedule=cosine",
        "--train.lr_scaling=sqrt", "--train.lr_reference_batch=64", "--val.every=3"])
    assert "lr 0.0005 = 0.001 x (16 / 64)^0.5 (sqrt scaling rule), cosine schedule" in capsys.readouterr().out
    log = rows(run)
    analysis = [r for r in log if "grad_norm_step" in r]
    assert [r["step"] for r in analysis] == [3, 6]
    for r in analysis:
        groups = {k.split("/")[1] for k in r if k.startswith("grad_norm/")}
        assert groups == {"patch_embed", "conditioning", "block_00", "block_01", "final_layer"}
        assert math.sqrt(sum(r[f"grad_norm/{g}"] ** 2 for g in groups)) == pytest.approx(r["grad_norm_step"], rel=1e-4)
        assert {k.split("/")[1] for k in r if k.startswith("update_ratio/")} == groups
    train = [r for r in log if "clip_share" in r]
    assert all(r["clip_share"] == 1.0 and r["clip_excess"] > 1 for r in train)  # a clip of 1e-3 always acts
    assert train[-1]["lr"] == pytest.approx(common.lr_at(5, 5e-4, 2, "cosine", 6))
    assert {r["step"] for r in log if "val_loss" in r} == {3, 6}
    report = (run / "report.md").read_text()
    for png in ("loss", "lr", "grad_norm", "update_ratio", "val_loss_bins"):
        assert f"report/{png}.png" in report and (run / "report" / f"{png}.png").stat().st_size > 5000


@pytest.mark.slow
def test_update_ratio_is_logged_for_real_optimizer_steps_only(tmp_path):
    """With accumulation, per optimizer step, equal to the change between consecutive checkpoints; a skipped
    (non-finite) step has gradient norms (and an exploding flag) but no update ratio."""
    args = tiny_run_args(tmp_path, "run", steps=4) + TINY_MODEL + [
        "--train.grad_accum=2", "--train.batch_size=8", "--log.grad_every=1", "--ckpt.every=1", "--ckpt.keep=100"]
    run = fm.main(args)
    model, _ = load_exported(run / "export")
    group_of = {name: g for g, ps in layer_groups(model).items() for p in ps
                for name, q in model.named_parameters() if q is p}
    ratios = {r["step"]: r for r in rows(run) if "grad_norm_step" in r}
    assert sorted(ratios) == [1, 2, 3, 4]  # optimizer steps, not the 8 micro-batches

    def weights(step):
        return load_file(str(run / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))

    for step in (2, 3, 4):
        before, after = weights(step - 1), weights(step)
        for g in set(group_of.values()):
            keys = [k for k, grp in group_of.items() if grp == g]
            delta = math.sqrt(sum((after[k] - before[k]).pow(2).sum().item() for k in keys))
            norm = math.sqrt(sum(before[k].pow(2).sum().item() for k in keys))
            assert ratios[step][f"update_ratio/{g}"] == pytest.approx(delta / norm, rel=1e-3)
    # Poison every training image: the next steps are skipped, so they have no update ratio.
    shard = next((tmp_path / "cache").glob("embedded-train-*/shard_00000.safetensors"))
    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(shard))
    tensors["x"][:] = float("nan")
    save_file(tensors, str(shard), metadata=meta)
    fm.main(args[:] + ["--train.max_steps=6", "--resume=latest", "--data.verify_cache=false"])  # headers only
    log = rows(run)
    skipped = [r for r in log if "grad_norm_step" in r and r["step"] in (5, 6)]
    assert len(skipped) == 2 and not any(k.startswith("update_ratio/") for r in skipped for k in r)
    assert {(r["step"], r["event"]) for r in log if r.get("event") == "grad_exploding"} >= {(5, "grad_exploding")}


def test_peak_memory_is_the_peak_of_each_log_interval(monkeypatch):
    """On CUDA each log reports its interval's allocator peak (the statistics reset after each read), so a
    large first interval does not mask the later ones; on the CPU, the process's peak RSS (no reset exists)."""
    from training.run.monitor import peak_memory

    allocator = {"peak": 0}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocator["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: allocator.update(peak=0))
    cuda = torch.device("cuda")
    reported = []
    for interval_peak in (5 * 2**30, 2**30, 3 * 2**30):
        allocator["peak"] = max(allocator["peak"], interval_peak)  # what the allocator records in the interval
        reported.append(peak_memory(cuda))
    assert reported == [5.0, 1.0, 3.0]
    import resource

    assert peak_memory(torch.device("cpu")) == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30



def driven_monitor(every, state=None):
    """A Monitor as the loop drives it (CPU, one-block model), logging into a list; log.every = `every`."""
    from accelerate import Accelerator

    from training.run import monitor

    cfg = config.load_config(fm.DEFAULTS, ["--train.max_steps=1000", f"--log.every={every}", "--log.grad_every=0",
                                           "--model.num_layers=1", "--data.num_classes=3"])
    rows = []
    mon = monitor.Monitor(cfg, build_denoiser(cfg, 3, 8), Accelerator(cpu=True), rows.append, state or {"step": 0})
    return mon, rows


def test_a_parts_loss_is_the_mean_of_its_own_samples_and_survives_a_checkpoint_mid_interval():
    """MeanFlow's parts (objectives/meanflow.py, parts): over an interval of two steps of 4 samples, loss_r_eq_t is
    the mean of the 3 samples with r = t (1, 2, 5) and loss_r_lt_t of the other 5, beside the whole batch's loss (4.5);
    a checkpoint between the two steps carries them, so the resumed monitor logs the same row."""
    from training.objectives import meanflow

    t = torch.tensor([0.9, 0.5, 0.8, 0.3])
    obj = {"meanflow_anchor": 0.0}
    steps = [(torch.tensor([1.0, 2.0, 3.0, 4.0]), meanflow.parts(t, torch.tensor([0.9, 0.5, 0.1, 0.2]), (0, 2), obj)),
             (torch.tensor([5.0, 6.0, 7.0, 8.0]), meanflow.parts(t, torch.tensor([0.9, 0.4, 0.1, 0.2]), (0, 1), obj))]

    def step(mon, loss, parts):
        mon.micro_batch(loss, torch.zeros(4, dtype=torch.long), 1.0, None, parts)
        mon.optimizer_step(torch.tensor(0.3), torch.tensor(True))

    straight, rows = driven_monitor(2)
    for loss, parts in steps:
        step(straight, loss, parts)
    straight.log_interval(2, 1e-3)
    first, _ = driven_monitor(2)
    step(first, *steps[0])
    resumed, again = driven_monitor(2, json.loads(json.dumps({"step": 1, **first.state_dict()})))
    step(resumed, *steps[1])
    resumed.log_interval(2, 1e-3)
    for row in (rows[-1], again[-1]):
        assert row["loss"] == pytest.approx(4.5)
        assert row["loss_r_eq_t"] == pytest.approx((1 + 2 + 5) / 3) and row["loss_r_lt_t"] == pytest.approx(28 / 5)
    for mon in (straight, first, resumed):
        mon.close()


def test_a_clip_acting_on_most_steps_is_an_event_once_per_episode_and_a_resume_keeps_the_window(capsys):
    """The clip (1.0) acts on 8 of every 10 steps, at 2x: after 50 steps (five intervals of log.every=10) one
    clip_share_high event (share 0.8, excess 2.0) and one printed line; no second while it stays high; none in a
    window where it acts on 2 of 10; a second event when it rises again. A monitor resumed from a checkpoint in the
    middle of a window (step 175) logs the same events as the uninterrupted one."""
    pattern = [True] * 50 + [True] * 50 + [False] * 50 + [True] * 100  # 250 steps: high, high, low, high x 2

    def run(mon, first, last):
        for step in range(first, last + 1):
            mostly = pattern[step - 1]
            clipped = (step % 10 < 8) if mostly else (step % 10 < 2)
            mon.micro_batch(torch.tensor([0.5]), torch.tensor([0]))
            mon.optimizer_step(torch.tensor(2.0 if clipped else 0.5), torch.tensor(True), 1.0)
            if step % 10 == 0:
                mon.log_interval(step, 1e-3)

    straight, rows = driven_monitor(10)
    run(straight, 1, 250)
    events = [r for r in rows if r.get("event") == "clip_share_high"]
    assert [(e["step"], e["clip_share"], e["steps"], e["clip_excess"], e["clip"]) for e in events] == \
        [(50, 0.8, 50, 2.0, 1.0), (200, 0.8, 50, 2.0, 1.0)]
    printed = [line for line in capsys.readouterr().out.splitlines() if "acted on" in line]
    assert printed[0] == ("step 50: the gradient clip (1) acted on 80% of the last 50 steps, at 2.00 x the clip on "
                          "average: it, not the LR, sets the size of those updates (docs/training.md, clip_share_high)")
    assert len(printed) == 2
    first, before = driven_monitor(10)
    run(first, 1, 175)
    resumed, after = driven_monitor(10, json.loads(json.dumps({"step": 175, **first.state_dict()})))
    run(resumed, 176, 250)
    assert [r for r in before + after if r.get("event")] == events
    for mon in (straight, first, resumed):
        mon.close()

