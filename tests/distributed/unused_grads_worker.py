"""Two decoder-like blocks under FSDP2 (``apply_fsdp2``) whose ``extra`` linear runs only on rows
of at least 8 positions; rank 0 gets 4 positions, rank 1 gets 10 (one process: both rows, each
alone); ``never`` runs nowhere. After one backward, rank 0 writes ``OUT/grads.pt``: every
trainable weight's full gradient (None where it has none). ``--no-fill`` leaves the blocks without ``fill_unused_grads`` (its hook is taken off
after sharding)."""

import argparse
from pathlib import Path

import torch

import twinkle
from twinkle import DeviceMesh
from twinkle.distributed.fsdp import apply_fsdp2


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.always = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)
        self.never = torch.nn.Linear(8, 8)  # no rank uses it: its gradient stays None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden + torch.tanh(self.always(hidden))
        if hidden.shape[1] >= 8:  # data-dependent: as a compressor that forms no block of short rows
            out = out + self.extra(hidden).mean(dim=1, keepdim=True)
        return out


class Net(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden = block(hidden)
        return hidden


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--no-fill", action="store_true")
    args = p.parse_args()
    runtime = twinkle.initialize(mode="local", global_device_mesh=DeviceMesh.from_sizes(), timeout_s=20)
    torch.manual_seed(0)
    net = Net()
    rows = [torch.randn(1, 4, 8), torch.randn(1, 10, 8)]
    if runtime.world_size > 1:
        apply_fsdp2(net, runtime.mesh, torch.device("cpu"), ["Block"])
        if args.no_fill:
            for block in net.blocks:
                block._forward_pre_hooks.popitem()  # the last registered: fill_unused_grads'
                block._forward_hooks.popitem()
        net(rows[runtime.rank]).pow(2).sum().backward()
    else:
        for row in rows:
            net(row).pow(2).sum().backward()
    grads = {}
    for name, param in net.named_parameters():
        grad = param.grad
        grads[name] = None if grad is None else (grad.full_tensor() if hasattr(grad, "full_tensor") else grad)
    if runtime.rank == 0:
        torch.save(grads, Path(args.out) / "grads.pt")


if __name__ == "__main__":
    main()
    twinkle.runtime.shutdown()
