"""The small model of ``notebooks/hunt.ipynb``: a two-block transformer with hand-written attention.

:class:`HandAttention` writes scaled dot-product attention out by hand, the way many research codebases do, and
forgets the ``1/sqrt(head_dim)`` scale unless ``scaled=True``. Trained in float16 autocast with a learning rate
that is too high (Adam, lr 0.1; the blocks have no LayerNorm), its query and key weights grow until ``q @ k^T`` exceeds float16's 65504: the matmul returns
inf, ``scores - scores.amax(...)`` turns it into NaN, and the block's output is NaN. The module boundary shows
the NaN; the op and the line are found by ``nantrace.hunt``. The classes live in an importable module so that
a reproducer (``Overflow.save_repro``) can rebuild them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "HandAttention", "TinyTransformer", "Trainer", "batch", "build"]


class HandAttention(nn.Module):
    """Single-head self-attention written out by hand; ``scaled=False`` leaves out the 1/sqrt(d) scale."""

    def __init__(self, d: int, scaled: bool = False) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.scale = 1 / math.sqrt(d) if scaled else 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        weights = weights / weights.sum(-1, keepdim=True)
        return self.o(weights @ v)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention and a GELU MLP, each in a residual branch."""

    def __init__(self, d: int, scaled: bool = False, norm: bool = True) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d) if norm else nn.Identity()
        self.attn = HandAttention(d, scaled)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """``embed`` (Linear) → ``blocks`` (2 × :class:`Block`) → ``head`` (Linear), on ``(batch, seq, d_in)``."""

    def __init__(
        self, d_in: int = 8, d: int = 32, n_blocks: int = 2, scaled: bool = False, norm: bool = True
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d, scaled, norm) for _ in range(n_blocks))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).squeeze(-1)


def batch(step: int, size: int = 8, seq: int = 16, d_in: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic batch, the same for the same ``step``: the target is the running mean of feature 0."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(size, seq, d_in, generator=g)
    y = x[..., 0].cumsum(-1) / torch.arange(1, seq + 1)
    return x, y


class Trainer:
    """Adam on ``model`` under float16 autocast (CPU); ``step(i)`` trains on :func:`batch` ``(i)`` and returns
    the loss. No GradScaler: loss scaling only concerns gradients, and the fault here is in the forward."""

    def __init__(self, model: nn.Module, lr: float = 0.1) -> None:
        self.model = model
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)

    def step(self, i: int) -> float:
        x, y = batch(i)
        self.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(self.model(x).float(), y)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())


def build(*, scaled: bool = False, seed: int = 0) -> TinyTransformer:
    """The notebook's model: ``TinyTransformer(d=16, norm=False, scaled=scaled)`` initialised from ``seed``."""
    torch.manual_seed(seed)
    return TinyTransformer(d=16, norm=False, scaled=scaled)
