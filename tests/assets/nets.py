"""Small modules for the LoRA-layer tests."""

import torch
from torch import nn


class TwoLinear(nn.Module):
    """``down(relu(up(x)))``: two LoRA targets, one with a bias and one without."""

    def __init__(self, width: int = 6, hidden: int = 10):
        super().__init__()
        self.up = nn.Linear(width, hidden, bias=True)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))
