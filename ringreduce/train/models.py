"""ResNet-18 for small images, written in plain torch.nn (no torchvision).

The variant used for CIFAR-sized inputs (He et al. 2016, section 4.2 style stem): a 3x3
convolution with stride 1 and padding 1 instead of the 7x7/2 convolution and max-pool of the
ImageNet model, then 4 stages of 2 basic residual blocks with 64/128/256/512 channels (stages
2-4 halve the resolution), global average pooling and a linear head.
"""

import torch
from torch import nn

STAGE_CHANNELS = (64, 128, 256, 512)


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity shortcut, or a 1x1 conv-BN projection where the
    block changes resolution or width."""

    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, in_channels=1, num_classes=10):
        super().__init__()
        if in_channels < 1:
            raise ValueError(f"in_channels must be >= 1, got {in_channels}")
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        width = STAGE_CHANNELS[0]
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        stages = []
        for i, channels in enumerate(STAGE_CHANNELS):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlock(width, channels, stride),
                                        BasicBlock(channels, channels, 1)))
            width = channels
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet18(in_channels=1, num_classes=10):
    """ResNet-18 for small images; about 11.2 M parameters (11,172,810 for 1 channel, 10 classes)."""
    return ResNet18(in_channels=in_channels, num_classes=num_classes)
