"""Reference models for the benchmark, sized for a CPU, trained on synthetic data.

Why these: scheduling only pays when communication is a large share of a step, so the
set spans the classic communication-heavy case (VGG-16: big fully connected layers at
the end, i.e. the last gradients ready are the first ones the next forward needs), a
compute-heavy one with many small tensors (ResNet-50's bottlenecks) and a Transformer
encoder (a large embedding at the input). `tiny` exists for quick tests.

Data is random and fixed: the benchmark measures step time, not accuracy, and
generating it outside the timed loop keeps data loading out of the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MODELS", "build", "default_batch", "make_batch", "loss", "param_count", "grad_bytes"]

NUM_CLASSES = 10


# ---------------------------------------------------------------- VGG-16

# The 13 convolutions of VGG-16 (configuration "D"); "M" is a 2x2 max-pool.
VGG16_CONVS = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
# After five pools a 32x32 input is 1x1x512. The classic 4096-4096 classifier would make
# 33.6M parameters; a 4096-2752 one makes 28,118,410 (112.5 MB of float32 gradients),
# the size the measurements in REFERENCES.md were taken with.
VGG16_HIDDEN = (4096, 2752)


class VGG16(nn.Module):
    """Plain conv+ReLU VGG-16 (no BatchNorm, as in the original) for 32x32x3 inputs."""

    def __init__(self, hidden=VGG16_HIDDEN, num_classes=NUM_CLASSES):
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for v in VGG16_CONVS:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(channels, v, 3, padding=1), nn.ReLU(inplace=True)]
                channels = v
        self.features = nn.Sequential(*layers)
        sizes = [channels, *hidden]
        fc: list[nn.Module] = []
        for a, b in zip(sizes, sizes[1:]):
            fc += [nn.Linear(a, b), nn.ReLU(inplace=True)]
        fc.append(nn.Linear(sizes[-1], num_classes))
        self.classifier = nn.Sequential(*fc)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


# ---------------------------------------------------------------- ResNet-50


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4), with a projection shortcut when shapes change."""

    expansion = 4

    def __init__(self, in_ch: int, planes: int, stride: int):
        super().__init__()
        out_ch = planes * self.expansion
        self.conv1 = nn.Conv2d(in_ch, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.shortcut = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_ch))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + self.shortcut(x))


class ResNet50(nn.Module):
    """ResNet-50's 3-4-6-3 bottleneck stages at half width (32..256 planes) for 32x32 inputs.

    CIFAR-style stem (one 3x3 conv, no max-pool) so the small image is not shrunk away;
    half width keeps a step under a second on one core.
    """

    def __init__(self, width: int = 32, blocks=(3, 4, 6, 3), num_classes=NUM_CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        stages: list[nn.Module] = []
        in_ch = width
        for i, n in enumerate(blocks):
            planes = width * 2 ** i
            for j in range(n):
                stages.append(Bottleneck(in_ch, planes, stride=2 if (i > 0 and j == 0) else 1))
                in_ch = planes * Bottleneck.expansion
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


# ---------------------------------------------------------------- Transformer


class TransformerClassifier(nn.Module):
    """Token + learned position embeddings, a post-norm encoder, mean-pool, linear head."""

    def __init__(self, vocab=8000, seq=64, d_model=512, heads=8, layers=6, ff=2048,
                 num_classes=NUM_CLASSES):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True)
        # enable_nested_tensor only matters with padding masks; off avoids its warning.
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.encoder(x).mean(dim=1))


# ---------------------------------------------------------------- tiny (tests)


class Tiny(nn.Module):
    """A few small layers: enough tensors for DDP buckets, fast enough for tests."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 128), nn.ReLU(),
                                 nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, NUM_CLASSES))

    def forward(self, x):
        return self.net(x)


# ---------------------------------------------------------------- registry


def _images(size: int):
    def make(batch: int, generator: torch.Generator):
        x = torch.randn(batch, 3, size, size, generator=generator)
        return x, torch.randint(0, NUM_CLASSES, (batch,), generator=generator)
    return make


def _tokens(vocab: int, seq: int):
    def make(batch: int, generator: torch.Generator):
        x = torch.randint(0, vocab, (batch, seq), generator=generator)
        return x, torch.randint(0, NUM_CLASSES, (batch,), generator=generator)
    return make


@dataclass(frozen=True)
class ModelSpec:
    build: Callable[[], nn.Module]
    default_batch: int
    make_batch: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]


# Default batches: vgg16's 96 is the one REFERENCES.md measured at 1 Gbit/s; the others
# give a one-thread step of about 0.5 s on a 2-core Xeon (vgg16 at 96: about 1.5 s).
MODELS: dict[str, ModelSpec] = {
    "vgg16": ModelSpec(VGG16, 96, _images(32)),
    "resnet50": ModelSpec(ResNet50, 16, _images(32)),
    "transformer": ModelSpec(TransformerClassifier, 8, _tokens(8000, 64)),
    "tiny": ModelSpec(Tiny, 16, _images(8)),
}


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}") from None


def build(name: str) -> nn.Module:
    return _spec(name).build()


def default_batch(name: str) -> int:
    return _spec(name).default_batch


def make_batch(name: str, batch: int, generator: torch.Generator):
    """(inputs, targets) of `batch` random samples drawn from `generator`."""
    return _spec(name).make_batch(batch, generator)


def loss(name: str, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Every reference model is a 10-class classifier."""
    _spec(name)
    return F.cross_entropy(output, targets)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def grad_bytes(model: nn.Module) -> int:
    """Bytes of gradient one step communicates (what DDP all-reduces)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
