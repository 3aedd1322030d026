"""The small model of ``notebooks/hunt.ipynb``: a two-block transformer with hand-written attention, fed
features whose scale drifts.

:class:`HandAttention` writes scaled dot-product attention out by hand, the way many research codebases do,
and forgets the ``1/sqrt(head_dim)`` scale unless ``scaled=True``. The data are unnormalised features whose
scale drifts upward (a sensor gain that creeps up, a count that accumulates): :func:`batch` multiplies step
``i``'s features by ``GROWTH ** i`` (2), while the target does not drift. With no LayerNorm before the
attention (``norm=False``), ``q`` and ``k`` grow with the input and ``q @ k^T`` with its square, ×4 per step;
Adam at lr 0.001 changes the weights by about 3% in the meantime. Trained in float16 autocast, ``q @ k^T``
exceeds float16's 65504 in ``blocks.0.attn`` at step 8: the matmul returns +inf, ``scores - scores.amax(...)``
turns it into NaN, and the block's output is NaN. The module boundary shows the NaN; the op and the line are
found by ``nantrace.hunt``. The overflow comes from the data's scale, not from the training trajectory, so it
is the same step on every CPU and torch version: computed in float32 from the run's weights, the largest
``|q @ k^T|`` is below 0.46 × 65504 at every step before step 8 and 2.4 × 65504 at step 8.

The fix is at the source: ``Trainer(normalize=True)`` divides each batch by its standard deviation, so nothing
grows with the step. ``scaled=True`` (``q`` times 1/4 before the product) is one step of the scores' growth:
it delays the ``q @ k^T`` overflow by a step. ``norm=True`` (a LayerNorm before each attention) keeps
``q @ k^T`` from growing, but the residual stream, the head's output and the loss still grow with the input.
The classes live in an importable module so that a reproducer (``Overflow.save_repro``) can rebuild them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "HandAttention", "TinyTransformer", "Trainer", "batch", "build"]


class HandAttention(nn.Module):
    """Single-head self-attention written out by hand; ``scaled=False`` leaves out the 1/sqrt(d) scale, which
    ``scaled=True`` applies to ``q`` before the product."""

    def __init__(self, d: int, scaled: bool = False) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.scale = 1 / math.sqrt(d) if scaled else 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        q = q * self.scale  # before the product, so that the product itself is smaller
        scores = q @ k.transpose(-2, -1)
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


GROWTH = 2.0  # the features' scale grows by this factor per step


def batch(step: int, size: int = 8, seq: int = 16, d_in: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic batch, the same for the same ``step``: features of scale ``GROWTH ** step`` (the drift),
    and as the target the running mean of feature 0 before that scale (the target does not drift)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(size, seq, d_in, generator=g)
    y = x[..., 0].cumsum(-1) / torch.arange(1, seq + 1)
    return x * GROWTH**step, y


class Trainer:
    """Adam on ``model`` under float16 autocast (CPU); ``step(i)`` trains on :func:`batch` ``(i)`` and returns
    the loss; ``normalize=True`` divides each batch's features by their standard deviation first (the fix: the
    model then sees unit-scale features at every step). No GradScaler: loss scaling only concerns gradients,
    and the fault here is in the forward."""

    def __init__(self, model: nn.Module, lr: float = 0.001, normalize: bool = False) -> None:
        self.model = model
        self.optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        self.normalize = normalize

    def step(self, i: int) -> float:
        x, y = batch(i)
        if self.normalize:
            x = x / x.std()
        self.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(self.model(x).float(), y)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())


def build(*, scaled: bool = False, norm: bool = False, seed: int = 11) -> TinyTransformer:
    """The notebook's model: ``TinyTransformer(d=16, norm=norm, scaled=scaled)`` initialised from ``seed``."""
    torch.manual_seed(seed)
    return TinyTransformer(d=16, norm=norm, scaled=scaled)
