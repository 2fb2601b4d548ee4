"""Recipes as data: each configs/*.json names only what it changes from the trainers' defaults, and loads
with both trainers; and what they cost: benchmarks/sizing.py's memory model. (Tiny versions of the paper
recipes run in test_conditioning.py and test_transfer.py.)"""
import json
import sys

import pytest
import torch

from training.config import config
import train_ddpm
import train_flow_matching
from conftest import ROOT

RECIPES = sorted(p for p in (ROOT / "configs").glob("*.json")  # sweeps: test_sweep.py; reference curves: test_curves.py
                 if not p.name.startswith("sweep_") and not p.name.endswith(".curves.json"))
TRAINERS = {"flow_matching": train_flow_matching.DEFAULTS, "ddpm": train_ddpm.DEFAULTS}


def same(a, b):
    """Equal as config values: 1 == 1.0 (load_config makes a float of an int), but true is not 1."""
    return a == b and (type(a) is bool) == (type(b) is bool)


def restated_defaults(recipe, defaults, prefix=""):
    """Dotted keys whose value in the recipe equals the default of every trainer that has the key: those
    lines change nothing and hide what the recipe is about. A key only one trainer has is method-specific
    and counts as a change (a recipe serves both trainers, so it should not hold one anyway)."""
    found = []
    for key, value in recipe.items():
        own = [d[key] for d in defaults if key in d]
        if isinstance(value, dict):
            found += restated_defaults(value, [d for d in own if isinstance(d, dict)], f"{prefix}{key}.")
        elif len(own) == len(defaults) and all(same(d, value) for d in own):
            found.append(f"{prefix}{key}={json.dumps(value)}")
    return found


def test_there_are_recipes():
    assert {"demo", "own_data_256", "imagenet256", "cc12m", "imagenet512"} <= {p.stem for p in RECIPES}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_no_recipe_restates_a_default_of_either_trainer(path):
    found = restated_defaults(json.loads(path.read_text()), list(TRAINERS.values()))
    assert not found, f"{path.name} restates the trainers' defaults: {found} (delete these lines)"


def test_the_restated_default_check_sees_nested_keys_and_both_trainers():
    defaults = list(TRAINERS.values())
    assert restated_defaults({"train": {"grad_clip": 1.0, "lr": 1e-4}}, defaults) == ["train.grad_clip=1.0"]
    assert restated_defaults({"conditioning": {"control_power": {"size": 1.0}}}, defaults) == \
        ["conditioning.control_power.size=1.0"]
    # val.steps is 32 for flow matching and 50 for DDPM: naming either value changes one of the trainers.
    assert restated_defaults({"val": {"steps": 50}}, defaults) == []
    assert restated_defaults({"data": {"label_column": None}}, defaults) == []  # default "label"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
@pytest.mark.parametrize("method", TRAINERS)
def test_every_recipe_loads_with_both_trainers(path, method):
    """A recipe that turns on a method's own option (objective.meanflow: configs/fashion_mnist_meanflow.json) loads with
    that trainer, and the other refuses each of its keys in a line that names the trainer to use."""
    if method == "ddpm" and json.loads(path.read_text()).get("objective", {}).get("meanflow"):
        with pytest.raises(config.ConfigError) as e:
            config.load_config(TRAINERS[method], ["--config", str(path)], method)
        assert all("use train_flow_matching.py" in line for line in str(e.value).splitlines()[1:])
        return
    cfg = config.load_config(TRAINERS[method], ["--config", str(path)], method)
    assert cfg.run_dir == f"runs/{method}_{path.stem}"
    if cfg.init_from:  # another recipe's run, or a pretrained SD3-family pipeline (test_sd3_base.py checks that one)
        assert cfg.init_from.startswith((f"runs/{method}_", "stabilityai/stable-diffusion-3"))


def test_the_single_gpu_recipe_sits_between_the_demo_and_the_paper_model():
    """own_data_256: a DiT-B-shaped MMDiT (12 layers, width 768) on latents of 256 px images, DiT's global
    batch 256 on one GPU; docs/paper.md derives its memory and step time from these numbers."""
    cfg = config.load_config(train_flow_matching.DEFAULTS, ["--config", str(ROOT / "configs/own_data_256.json")])
    model = cfg.model
    assert (model.num_layers, model.num_attention_heads * model.attention_head_dim, model.patch_size) == (12, 768, 2)
    assert cfg.data.resolution == 256 and cfg.encoders.vae and cfg.train.mixed_precision == "bf16"
    assert cfg.train.batch_size * cfg.train.grad_accum == 256


# What a recipe costs: benchmarks/sizing.py's memory model, on shrunk recipes (CPU, seconds).
TINY = ["--data.resolution=32", "--model.num_attention_heads=2", "--model.attention_head_dim=16"]


@pytest.fixture
def sizing():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import sizing
        yield sizing
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.parametrize("name", ["own_data_256"])
def test_the_activation_model_extrapolates_to_what_a_deeper_forward_saves(sizing, name):
    """The model is measured at 1-2 blocks and 1-2 images; at 4 blocks and 3 images it must give what a forward of
    that size saves. With checkpointing it adds one block's recomputed activations to the measurement (the
    block inputs are in it: the non-reentrant checkpoint saves them)."""
    cfg = sizing.load_recipe(name, TINY)
    parts = sizing.linear_model(lambda n, b: sizing.saved_bytes(cfg, n, b))
    ckpt_parts = sizing.linear_model(lambda n, b: sizing.saved_bytes(cfg, n, b, checkpointing=True))
    assert sizing.activation_bytes(cfg, 4, 3, parts) == sizing.saved_bytes(cfg, 4, 3)
    (fixed, per_image) = parts
    one_block = (fixed[1] - fixed[0]) + 3 * (per_image[1] - per_image[0])
    assert (sizing.checkpointed_activation_bytes(cfg, 4, 3, parts, ckpt_parts) - one_block
            == sizing.saved_bytes(cfg, 4, 3, checkpointing=True))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_sharded_measurement_saves_what_fully_shard_saves(sizing, tmp_path, checkpointing):
    """fully_sharded_like stands in for fully_shard(MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))
    on every block and the root: the same bytes saved for backward as the real thing on one CPU process (the
    root's gathered parameters, held through the step, not counted: memory_per_gpu's transient has them)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    cfg = sizing.load_recipe("cc12m", TINY)
    small = config.load_config(train_flow_matching.DEFAULTS, ["--config", cfg.config_path, "--model.num_layers=2",
                                                              *cfg.extra])
    x0, cond, text_dims = sizing.model_inputs(small, 2, torch.device("cpu"))
    model = sizing.build(small, x0, text_dims, torch.device("cpu"), checkpointing=checkpointing)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = init_device_mesh("cpu", (1,))
        for block in model.transformer.transformer_blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        storages = {}

        def keep(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage()
            return t
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            train_flow_matching.flow_matching_loss(model, x0, cond, torch.rand(2), torch.randn_like(x0))
        root = {p.untyped_storage().data_ptr() for p in model.parameters() if not isinstance(p, DTensor)}
        assert root  # the root's parameters stay gathered after the forward
        real = sum(s.nbytes() for ptr, s in storages.items() if ptr not in root)  # the blocks': freed, 0 bytes
    finally:
        dist.destroy_process_group()
    assert sizing.saved_bytes(cfg, 2, 2, checkpointing, sharded=True) == real
    assert real < sizing.saved_bytes(cfg, 2, 2, checkpointing)  # no bf16 copies of the weights kept


@pytest.mark.parametrize("gpus", [8, 16])
def test_the_sharded_memory_is_one_shards_states_plus_what_is_gathered(sizing, gpus):
    """memory_per_gpu against the shard that fully_shard gives rank 0 of `gpus` (a fake process group, the model
    on the meta device): fp32 weights, gradients, two Adam moments, the EMA and two post-hoc EMA profiles of that
    shard, plus the gathered bf16 blocks and root, plus, accumulating, an unsharded fp32 gradient of the whole
    model. DDP keeps it all on every GPU, whatever their number."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg = sizing.load_recipe("own_data_256", ["--model.num_attention_heads=4", "--model.attention_head_dim=64"])
    x0, cond, text_dims = sizing.model_inputs(cfg, 1, torch.device("meta"))
    model = sizing.build(cfg, x0, text_dims, torch.device("meta"), checkpointing=False)
    params, blocks = sum(p.numel() for p in model.parameters()), model.transformer.transformer_blocks
    block, root = max(sum(p.numel() for p in b.parameters()) for b in blocks), params - sum(
        p.numel() for b in blocks for p in b.parameters())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=gpus)
    try:
        mesh = init_device_mesh("cpu", (gpus,))
        for b in blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        shard = sum(p.to_local().numel() for p in model.parameters())  # rank 0's: dim 0 split, padded
    finally:
        dist.destroy_process_group()
    gathered, activations = 2 * (2 * block + root) + (2 + 4) * block, 3 * 2**30
    for accumulating in (False, True):
        expected = (4 + 4 + 8 + 4 + 2 * 4) * shard + 4 * params * accumulating + gathered + activations
        got = sizing.memory_per_gpu(params, activations, gpus, True, 2, accumulating, block, root)
        assert got == pytest.approx(expected, rel=2e-3)
    assert sizing.memory_per_gpu(params, activations, gpus, profiles=2) == 28 * params + activations


def test_the_deepest_model_is_the_last_depth_under_the_budget(sizing):
    for budget, depth in [(40, 10), (42.9, 10), (43, 11), (12.9, 0), (13, 1)]:  # memory 10 + 3 L
        assert sizing.deepest(lambda n: 10 + 3 * n, budget) == depth
    assert sizing.deepest(lambda n: 0.1 + 0.2 * n, 0.7) == 2  # 0.1 + 0.6 is 0.7000000000000001; the closed form says 3
    assert sizing.deepest(lambda n: 0.1 * n, 0.5) == 5  # 0.1 * 5 is 0.5; the closed form says 4
