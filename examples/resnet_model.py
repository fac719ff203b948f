"""The model and data of the ResNet examples (``resnet_plain.py``, and ``resnet_port.py``, the
same loop as a ddiloco learner): a small ResNet with BatchNorm, and generated images (ten
classes of 3x16x16 patterns under a random brightness and noise), so they run anywhere."""

import torch
import torch.nn.functional as F
from torch import nn

PATTERNS = torch.randn(10, 3, 16, 16, generator=torch.Generator().manual_seed(1234))


def images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images and their labels, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    bright = 1 + torch.rand(n, 1, 1, 1, generator=g)
    return PATTERNS[labels] * bright + 0.5 + 3 * torch.randn(n, 3, 16, 16, generator=g), labels


class Block(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a skip connection."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class ResNet(nn.Module):
    """A stem, two residual blocks, global average pooling and a linear head."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def held_out_loss(model: nn.Module) -> float:
    """Cross-entropy on 2,000 held-out images, in eval mode (BatchNorm's running statistics)."""
    x, y = images(2000, seed=999_999)
    model.eval()
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()
