"""train.optimizer="muon" (training/optimisation/muon.py): which parameters go to Muon, a step equal to
torch.optim.Muon and AdamW called directly on the same groups, a non-finite step that changes nothing, the state through
state_dict, exact resume of a trainer run, and the start-up refusals."""
import copy
from pathlib import Path

import pytest
import torch

import train_flow_matching as fm
from conftest import tiny_run_args
from training.config import config
from training.model.mmdit import build_denoiser
from training.optimisation import muon, optimizers
from training.run import fit


def tiny(muon_lr=None, **train):
    cfg = config.load_config(fm.DEFAULTS, ["--model.num_layers=2", "--model.num_attention_heads=2",
                                           "--model.attention_head_dim=8", "--model.qk_norm=rms_norm",
                                           "--data.num_classes=3"], method="flow_matching")
    cfg.train.update({"optimizer": "muon", "muon_lr": muon_lr, "weight_decay": 0.01, **train})
    torch.manual_seed(0)
    return build_denoiser(cfg, 4, 8), cfg.train


def backward(model, seed):
    torch.manual_seed(seed)
    x, cond = torch.randn(4, 4, 8, 8), {"label": torch.tensor([0, 1, 2, 3]), "drop": torch.zeros(4, dtype=torch.bool)}
    model(x, torch.rand(4) * 1000, cond).pow(2).mean().backward()


def test_the_blocks_matrices_go_to_muon_and_everything_else_to_adamw():
    model, _ = tiny()
    names, _ = zip(*muon.split(model)[0])
    both = ["norm1.linear", "norm1_context.linear", "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj",
            "attn.add_k_proj", "attn.add_v_proj", "attn.to_out.0", "ff.net.0.proj", "ff.net.2"]
    # not in the last block (context_pre_only)
    context = ["attn.to_add_out", "ff_context.net.0.proj", "ff_context.net.2"]
    assert sorted(names) == sorted(f"transformer.transformer_blocks.{i}.{leaf}.weight"
                                   for i, leaves in ((0, both + context), (1, both)) for leaf in leaves)
    rest = dict(muon.split(model)[1])
    for name in ("transformer.pos_embed.proj.weight", "transformer.context_embedder.weight",  # embeddings
                 "transformer.time_text_embed.timestep_embedder.linear_1.weight",
                 "transformer.transformer_blocks.0.attn.norm_q.weight",
                 "transformer.transformer_blocks.0.attn.to_q.bias",
                 "conditioner.class_embed.weight", "transformer.norm_out.linear.weight", "transformer.proj_out.weight"):
        assert name in rest, name  # norms, biases, the conditioner and the final layer
    assert len(names) + len(rest) == len(list(model.parameters()))


@pytest.mark.parametrize("lr", [1e-3, 0.0])  # 0: the AdamW group frozen, the blocks still at train.muon_lr
def test_a_step_equals_torch_muon_and_adamw_called_directly_on_the_same_groups(lr):
    """Non-default betas and weight decay (a DiT's (0.9, 0.95), 0.05; torch's defaults are (0.9, 0.999), Muon's
    0.1, AdamW's 0.01) reach the groups they belong to."""
    model, tr = tiny(muon_lr=3e-3, lr=lr, betas=[0.9, 0.95], weight_decay=0.05)
    twin = copy.deepcopy(model)
    ours = optimizers.make_optimizer(model, tr)
    assert [(g["lr"], g["weight_decay"], g.get("betas")) for g in ours.param_groups] == [
        (3e-3, 0.05, None), (lr, 0.05, (0.9, 0.95))]  # Muon's group has momentum, not betas
    split = muon.split(twin)
    direct = [torch.optim.Muon([p for _, p in split[0]], lr=3e-3, weight_decay=0.05, adjust_lr_fn="match_rms_adamw"),
              torch.optim.AdamW([p for _, p in split[1]], lr=lr, betas=(0.9, 0.95), weight_decay=0.05, fused=True)]
    for step, factor in enumerate((1.0, 0.5)):  # the schedule's factor multiplies each group's own LR
        assert fit.set_lr(ours, tr, factor) == factor * lr  # train.lr's, the one logged
        direct[0].param_groups[0]["lr"], direct[1].param_groups[0]["lr"] = factor * 3e-3, factor * lr
        backward(model, step), backward(twin, step)
        optimizers.skip_update_if_nonfinite(ours, torch.tensor(True))  # the trainers' path: found_inf = 0
        ours.step()
        for opt in direct:
            opt.step()
        for (name, a), b in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(a, b), name
        ours.zero_grad(), [opt.zero_grad() for opt in direct]
    start, blocks = dict(tiny()[0].named_parameters()), dict(split[0])
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, start[name])}
    assert moved == (start.keys() if lr else blocks.keys())  # train.lr=0: the blocks train, the rest stays


def test_a_nonfinite_step_leaves_weights_and_state_bitwise_unchanged():
    model, tr = tiny()
    opt = optimizers.make_optimizer(model, tr)
    for first in (True, False):  # before any state exists, and after a real step
        if not first:
            backward(model, 0)
            optimizers.skip_update_if_nonfinite(opt, torch.tensor(True))
            opt.step()
            opt.zero_grad()
        weights = [p.detach().clone() for p in model.parameters()]
        states = copy.deepcopy(opt.state_dict()["state"])
        backward(model, 1)
        next(p for name, p in muon.split(model)[0]).grad[0, 0] = float("nan")
        optimizers.skip_update_if_nonfinite(opt, torch.tensor(False))
        opt.step()
        opt.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
        after = opt.state_dict()["state"]
        for i, values in after.items():
            for key, value in values.items():
                assert torch.equal(value, states[i][key] if i in states else torch.zeros_like(value)), (first, i, key)


def test_the_momentum_and_moments_travel_through_state_dict():
    model, tr = tiny(muon_lr=2e-3, lr=1e-3)
    opt = optimizers.make_optimizer(model, tr)
    for step in range(2):
        backward(model, step)
        opt.step()
        opt.zero_grad()
    saved = copy.deepcopy(opt.state_dict())
    assert {k for v in saved["state"].values() for k in v} == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}
    twin = copy.deepcopy(model)
    today = {**tr, "muon_lr": 4e-3}  # a resume that changes train.muon_lr
    resumed = muon.MuonAdamW(twin, today)
    resumed.load_state_dict(saved)
    fit.set_lr(opt, tr, 0.25), fit.set_lr(resumed, today, 0.25)
    assert resumed.param_groups[0]["lr"] == 1e-3  # today's 4e-3 x 0.25, not the checkpoint's 2e-3
    opt.param_groups[0]["lr"] = resumed.param_groups[0]["lr"]
    for o, m in ((opt, model), (resumed, twin)):
        backward(m, 2)
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    with pytest.raises(ValueError, match="not train.optimizer='muon''s"):
        resumed.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())


def test_muon_is_refused_with_fsdp_on_an_old_torch_and_its_lr_without_it(tmp_path, monkeypatch):
    def problems(*extra):
        with pytest.raises(config.ConfigError) as e:
            fm.main(tiny_run_args(tmp_path) + list(extra))
        return str(e.value)

    message = problems("--train.optimizer=muon", "--train.sharding=fsdp")
    assert "train.optimizer='muon' with train.sharding='fsdp'" in message
    assert "--train.optimizer=adamw --train.muon_lr=null" in message  # how to leave a recipe's Muon
    assert "train.muon_lr=0.01 is Muon's LR" in problems("--train.muon_lr=0.01")
    monkeypatch.delattr(torch.optim, "Muon")
    assert "train.optimizer='muon' needs torch.optim.Muon, new in torch 2.9" in problems("--train.optimizer=muon")
    assert not (tmp_path / "run").exists()  # refused before any work


def test_the_recipe_trains_with_muon_and_says_how_to_leave_it(monkeypatch):
    """configs/fashion_mnist.json sets Muon at 1e-2 (docs/benchmarks/real_options.md); AdamW alone is refused naming the
    argument that unsets Muon's LR, and with it the recipe loads on AdamW."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the recipe names its curves from the root

    def load(*extra):
        return config.load_config(fm.DEFAULTS, ["--config", "configs/fashion_mnist.json", *extra],
                                  method="flow_matching", schema=fm.CONFIG)
    recipe = load().train
    assert (recipe.optimizer, recipe.muon_lr) == ("muon", 1e-2)
    with pytest.raises(config.ConfigError, match=r"train.muon_lr=0.01 is Muon's LR.*--train.muon_lr=null"):
        load("--train.optimizer=adamw")
    assert load("--train.optimizer=adamw", "--train.muon_lr=null").train.optimizer == "adamw"


@pytest.mark.slow
def test_a_muon_run_resumes_exactly(tmp_path):
    """bf16, 2 micro-batches a step: 4 steps straight vs 2, then --resume latest to 4: bitwise the same weights,
    EMA, Muon momentum, Adam moments and losses."""
    from test_robustness import assert_same_checkpoint

    extra = ["--train.optimizer=muon", "--train.muon_lr=3e-3", "--train.mixed_precision=bf16", "--train.grad_accum=2",
             "--train.batch_size=8", "--model.num_layers=1", "--log.every=1", "--ckpt.every=2"]
    fm.main(tiny_run_args(tmp_path, "straight", steps=4) + extra)
    fm.main(tiny_run_args(tmp_path, "resumed", steps=2) + extra)
    fm.main(tiny_run_args(tmp_path, "resumed", steps=4) + extra + ["--resume=latest"])
    assert_same_checkpoint(tmp_path / "straight", tmp_path / "resumed", 4)
