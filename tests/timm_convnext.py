"""timm's ConvNeXt as its code is written (timm/models/convnext.py, timm 1.0; abridged to
the paths convnext_atto takes: conv_mlp=False, so an MLP of Linears over channels-last
activations; no GRN, no drop path, no gradient checkpointing). timm needs torchvision,
which has no CPU build for the torch these tests pin (see timm_vit.py): so the model is
written here the way timm writes it. Its blocks sit in stages (a Sequential of stages,
each a downsample and a Sequential of blocks): tp's derivation once traced the stages
as a second stack around the blocks and never settled (issue 49)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm_vit import Mlp  # timm.layers.Mlp, which ConvNeXt shares with the ViT


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm for channels of '2D' spatial NCHW tensors"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        x = x.permute(0, 3, 1, 2)
        return x


class ConvNeXtBlock(nn.Module):
    """ConvNeXt Block: DwConv -> Permute to (N, H, W, C); LayerNorm (channels_last) ->
    Linear -> GELU -> Linear; Permute back"""

    def __init__(self, in_chs, kernel_size=7, mlp_ratio=4, ls_init_value=1e-6):
        super().__init__()
        self.conv_dw = nn.Conv2d(
            in_chs, in_chs, kernel_size, padding=kernel_size // 2, groups=in_chs, bias=True
        )
        self.norm = nn.LayerNorm(in_chs, eps=1e-6)
        self.mlp = Mlp(in_chs, int(mlp_ratio * in_chs))
        self.gamma = nn.Parameter(ls_init_value * torch.ones(in_chs))
        self.shortcut = nn.Identity()
        self.drop_path = nn.Identity()

    def forward(self, x):
        shortcut = x
        x = self.conv_dw(x)
        x = x.permute(0, 2, 3, 1)
        x = self.norm(x)
        x = self.mlp(x)
        x = x.permute(0, 3, 1, 2)
        if self.gamma is not None:
            x = x.mul(self.gamma.reshape(1, -1, 1, 1))
        x = self.drop_path(x) + self.shortcut(shortcut)
        return x


class ConvNeXtStage(nn.Module):
    def __init__(self, in_chs, out_chs, stride=2, depth=2, ls_init_value=1.0):
        super().__init__()
        if in_chs != out_chs or stride > 1:
            self.downsample = nn.Sequential(
                LayerNorm2d(in_chs, eps=1e-6),
                nn.Conv2d(in_chs, out_chs, kernel_size=stride, stride=stride, bias=True),
            )
        else:
            self.downsample = nn.Identity()
        self.blocks = nn.Sequential(
            *[ConvNeXtBlock(out_chs, ls_init_value=ls_init_value) for _ in range(depth)]
        )

    def forward(self, x):
        x = self.downsample(x)
        x = self.blocks(x)
        return x


class ConvNeXt(nn.Module):
    def __init__(
        self,
        in_chans=3,
        num_classes=1000,
        depths=(3, 3, 9, 3),
        dims=(96, 192, 384, 768),
        ls_init_value=1e-6,
        patch_size=4,
    ):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_chans, dims[0], kernel_size=patch_size, stride=patch_size, bias=True),
            LayerNorm2d(dims[0], eps=1e-6),
        )
        stages = []
        prev_chs = dims[0]
        for i in range(len(depths)):
            stride = 2 if i > 0 else 1
            stages.append(
                ConvNeXtStage(
                    prev_chs, dims[i], stride=stride, depth=depths[i], ls_init_value=ls_init_value
                )
            )
            prev_chs = dims[i]
        self.stages = nn.Sequential(*stages)
        self.norm_pre = nn.Identity()
        self.head = nn.Sequential()
        self.head.norm = LayerNorm2d(prev_chs, eps=1e-6)
        self.head.flatten = nn.Flatten(1)
        self.head.fc = nn.Linear(prev_chs, num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        x = self.norm_pre(x)
        x = x.mean((2, 3), keepdim=True)
        return self.head.fc(self.head.flatten(self.head.norm(x)))


def convnext_atto(**kwargs) -> ConvNeXt:
    """timm's convnext_atto: depths (2, 2, 6, 2), dims (40, 80, 160, 320); the tests
    pass smaller depths and dims, as timm's create_model(..., **kwargs) takes them."""
    return ConvNeXt(**{"depths": (2, 2, 6, 2), "dims": (40, 80, 160, 320), **kwargs})
