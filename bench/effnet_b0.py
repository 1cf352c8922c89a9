"""An EfficientNet-B0-shaped CNN (MBConv blocks with squeeze-excitation, BatchNorm, SiLU;
the B0 stage widths, depths, kernels and strides), written out so it needs no timm."""

import torch
from torch import nn

# (expansion, out channels, repeats, stride, kernel) - EfficientNet-B0
STAGES = [(1, 16, 1, 1, 3), (6, 24, 2, 2, 3), (6, 40, 2, 2, 5), (6, 80, 3, 2, 3), (6, 112, 3, 1, 5),
          (6, 192, 4, 2, 5), (6, 320, 1, 1, 3)]


def conv_bn(cin, cout, k, s, groups=1, act=True):
    layers = [nn.Conv2d(cin, cout, k, s, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, nn.SiLU()) if act else nn.Sequential(*layers)


class SqueezeExcite(nn.Module):
    def __init__(self, channels, reduced):
        super().__init__()
        self.reduce = nn.Conv2d(channels, reduced, 1)
        self.expand = nn.Conv2d(reduced, channels, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)
        return x * torch.sigmoid(self.expand(nn.functional.silu(self.reduce(s))))


class MBConv(nn.Module):
    def __init__(self, cin, cout, expansion, stride, kernel):
        super().__init__()
        mid = cin * expansion
        self.expand = conv_bn(cin, mid, 1, 1) if expansion != 1 else nn.Identity()
        self.depthwise = conv_bn(mid, mid, kernel, stride, groups=mid)
        self.se = SqueezeExcite(mid, max(1, cin // 4))
        self.project = conv_bn(mid, cout, 1, 1, act=False)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        out = self.project(self.se(self.depthwise(self.expand(x))))
        return x + out if self.residual else out


class EfficientNetB0(nn.Module):
    def __init__(self, classes=1000):
        super().__init__()
        layers, cin = [conv_bn(3, 32, 3, 2)], 32
        for expansion, cout, repeats, stride, kernel in STAGES:
            for i in range(repeats):
                layers.append(MBConv(cin, cout, expansion, stride if i == 0 else 1, kernel))
                cin = cout
        layers.append(conv_bn(cin, 1280, 1, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(1280, classes)

    def forward(self, x):
        return self.classifier(self.features(x).mean((2, 3)))


def get_model():
    return EfficientNetB0()


def example_inputs():
    return (torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0)),)
