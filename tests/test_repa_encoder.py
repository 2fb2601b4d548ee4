"""tools/repa_encoder.py: REPA's in-domain encoder is trained on the training split alone, and its folder, and the
random control's, load through repa_targets.py's hub-id path (AutoModel / AutoImageProcessor) with the training
normalisation; the control holds the weights training started from. Tiny sizes: a 1-block width-16 DINOv2 on
96 fake images."""
import json

import numpy as np
import pytest
import torch

from tools import repa_encoder
from training.data import fashion_mnist, repa_targets


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The command run once on a fake Fashion-MNIST: the splits it asked for, its output folder and record."""
    asked, out = [], tmp_path_factory.mktemp("encoder")
    rng = np.random.default_rng(0)

    def split_arrays(split, folder=None):
        asked.append(split)
        n = {"train": 96, "test": 40}[split]
        return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), np.arange(n, dtype=np.uint8) % 10

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fashion_mnist, "split_arrays", split_arrays)
        mp.setattr(repa_encoder, "ARCH", {**repa_encoder.ARCH, "hidden_size": 16, "num_hidden_layers": 1,
                                          "num_attention_heads": 2})
        mp.setattr(repa_encoder, "HELDOUT", 32)
        record = repa_encoder.main(["--out", str(out), "--epochs", "1"])
        start = repa_encoder.build(10, seed=1).dinov2.state_dict()  # --seed 1, the default: the initial weights
    return asked, out, record, start


def test_it_trains_on_the_training_split_alone_and_holds_rows_out_for_the_probes(made):
    asked, out, record, _ = made
    assert asked == ["train"]
    assert (record["trained_rows"], record["heldout_rows"]) == (64, 32)
    assert json.loads((out / "encoder.json").read_text()) == record
    for name in ("trained", "random"):
        assert set(record[name]) == {"knn_accuracy", "linear_probe_accuracy", "token_cosine_between_images"}


@pytest.mark.slow  # about 1.5 s: the fast tier keeps its 60 s on 2 cores
def test_both_folders_load_through_the_hub_id_path_with_the_training_normalisation(made):
    _, out, record, _ = made
    for name in ("trained", "random"):
        encoder = repa_targets.load_encoder(str(out / name), torch.device("cpu"))
        assert (encoder.patch, encoder.dim) == (4, 16)
        torch.testing.assert_close(encoder.mean.flatten(), torch.full((3,), record["pixel_mean"]))
        torch.testing.assert_close(encoder.std.flatten(), torch.full((3,), record["pixel_std"]))
        pixels = torch.rand(2, 3, 28, 28) * 2 - 1
        assert repa_targets.encoder_targets(encoder, pixels, 7).shape == (2, 49, 16)  # the recipe's 7 x 7 grid
        assert repa_targets.encoder_config(str(out / name)).hidden_size == 16  # what attach() sizes the projector by


def test_the_control_is_the_same_network_at_the_weights_training_started_from(made):
    from transformers import Dinov2Model

    _, out, _, start = made
    trained, random = (Dinov2Model.from_pretrained(str(out / name)) for name in ("trained", "random"))
    assert (out / "trained" / "config.json").read_text() == (out / "random" / "config.json").read_text()
    changed = [k for k, v in trained.state_dict().items() if not torch.equal(v, random.state_dict()[k])]
    assert len(changed) > len(trained.state_dict()) // 2  # training moved the weights
    assert all(torch.equal(v, start[k]) for k, v in random.state_dict().items())
