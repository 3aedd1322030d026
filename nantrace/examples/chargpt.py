"""A small character-level GPT trained on the Python standard library's own source code.

This is the workload behind ``nantrace demo``. Nothing is downloaded: the corpus is the ``.py`` files that
ship with every CPython installation (found through :func:`sysconfig.get_paths`), the model is a plain
decoder-only transformer, and the training loop is the textbook automatic-mixed-precision loop
(``autocast`` + ``GradScaler``).

The default :class:`DemoConfig` is deliberately *fragile* but not rigged: the transformer blocks have no
LayerNorms (``norm=False``; the final ``ln_f`` is kept) and the learning rate warms up towards a peak that
is far too high. Nothing plants an ``inf``. Training starts normally: the loss falls, and the loss scale
backs off from its large initial value (``init_scale=2**20``) in the first steps, and again during a loss
spike, as scaled float16 gradients overflow, which is the scaler doing its routine job. As the learning
rate climbs, the query and key weights grow, and the attention logits ``q @ k^T``, quadratic in those
weights, grow fastest of all (the "attention logit growth" instability). After a couple of dozen steps the
float16 matmul in ``blocks.<i>.attn.scores`` exceeds the float16 range (``|x| > 65504``) and returns
``inf`` (often ``-inf``: huge negative logits) in the *forward* pass; the softmax turns whole rows into
NaN and the loss is NaN in that same step. Loss scaling cannot
help: it only protects gradients, so the scaler just keeps halving the scale and skipping steps.

The same run in bfloat16, which has float32's exponent range, stays finite, and because ``ln_f``
normalises the residual stream before ``lm_head`` its loss even looks healthy, while the attention logits
inside silently reach 1e12 and beyond. Setting ``norm=True`` (pre-LayerNorm blocks, as in GPT-2) and a
moderate learning rate (e.g. ``lr=3e-3``) gives an ordinary, healthy float16 run.
"""

from __future__ import annotations

import glob
import math
import os
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MLP",
    "UNKNOWN_CHAR",
    "AttentionScores",
    "Block",
    "CausalSelfAttention",
    "CharGPT",
    "DemoConfig",
    "batches",
    "build",
    "build_vocab",
    "decode",
    "encode",
    "load_corpus",
    "stdlib_source_files",
    "train_step",
    "warmup_lr",
]

#: Placeholder character for everything outside printable ASCII and newline (token id 0).
UNKNOWN_CHAR = "\ufffd"

DType = Literal["float16", "bfloat16"]

_NON_VOCAB = re.compile(r"[^\n\x20-\x7e]")


# --------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------


def build_vocab() -> list[str]:
    """Return the fixed character vocabulary.

    Index 0 is :data:`UNKNOWN_CHAR`, index 1 is ``"\\n"``, followed by the 95 printable ASCII characters
    from space (0x20) to tilde (0x7E): 97 symbols in total. The vocabulary does not depend on the corpus,
    so token ids mean the same thing on every machine.
    """
    return [UNKNOWN_CHAR, "\n", *(chr(c) for c in range(0x20, 0x7F))]


def encode(text: str, vocab: list[str]) -> torch.Tensor:
    """Map ``text`` to a 1-D ``int64`` tensor of token ids; characters not in ``vocab`` become id 0."""
    if not text:
        return torch.zeros(0, dtype=torch.int64)
    if vocab == build_vocab():
        # Fast path for the standard vocabulary: every out-of-vocabulary character becomes one NUL byte,
        # then the pure-ASCII bytes are looked up in a 128-entry table.
        ascii_text = _NON_VOCAB.sub("\0", text).encode("ascii")
        codes = torch.frombuffer(bytearray(ascii_text), dtype=torch.uint8).to(torch.int64)
        return _ascii_lookup(vocab)[codes]
    index = {ch: i for i, ch in enumerate(vocab)}
    return torch.tensor([index.get(ch, 0) for ch in text], dtype=torch.int64)


def _ascii_lookup(vocab: list[str]) -> torch.Tensor:
    """Return a 128-entry table mapping ASCII codes to token ids (0 for codes not in ``vocab``)."""
    table = torch.zeros(128, dtype=torch.int64)
    for i, ch in enumerate(vocab):
        if len(ch) == 1 and ord(ch) < 128:
            table[ord(ch)] = i
    return table


def decode(ids: torch.Tensor | list[int], vocab: list[str]) -> str:
    """Map token ids back to text (the inverse of :func:`encode` up to unknown characters)."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    return "".join(vocab[int(i)] for i in values)


def stdlib_source_files() -> list[str]:
    """Return the public top-level ``.py`` modules of the running interpreter's standard library, sorted.

    Private modules (leading underscore) are skipped; they include generated files such as
    ``_sysconfigdata_*.py`` that are configuration dumps rather than code. Raises :class:`FileNotFoundError`
    when the standard library ships without sources (some embedded or stripped distributions).
    """
    candidates = [sysconfig.get_paths()["stdlib"], os.path.dirname(os.__file__)]
    for directory in candidates:
        files = sorted(
            path
            for path in glob.glob(os.path.join(directory, "*.py"))
            if not os.path.basename(path).startswith("_")
        )
        if files:
            return files
    raise FileNotFoundError(f"no standard-library .py sources found in {candidates}")


def load_corpus(max_chars: int = 300_000) -> tuple[torch.Tensor, list[str]]:
    """Load up to ``max_chars`` characters of standard-library source code as token ids.

    Files from :func:`stdlib_source_files` are read in sorted order and concatenated (the last one is
    truncated), so the corpus is deterministic for a given Python version.

    Returns:
        ``(ids, vocab)``: a 1-D ``int64`` tensor of token ids and the vocabulary from :func:`build_vocab`.
    """
    if max_chars < 2:
        raise ValueError("max_chars must be at least 2")
    parts: list[str] = []
    total = 0
    for path in stdlib_source_files():
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
        parts.append(text[: max_chars - total])
        total += len(parts[-1])
        if total >= max_chars:
            break
    vocab = build_vocab()
    return encode("".join(parts), vocab), vocab


def batches(
    ids: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield an endless stream of random ``(x, y)`` training windows.

    Each batch holds ``batch_size`` windows of ``block_size`` consecutive tokens starting at offsets drawn
    with ``generator``; ``y`` is ``x`` shifted by one token (next-character targets). Both are ``int64`` of
    shape ``(batch_size, block_size)`` on the CPU.
    """
    if ids.ndim != 1 or ids.numel() <= block_size + 1:
        raise ValueError("ids must be a 1-D tensor longer than block_size + 1")
    span = torch.arange(block_size + 1)
    high = ids.numel() - block_size - 1
    while True:
        starts = torch.randint(0, high + 1, (batch_size,), generator=generator)
        windows = ids[starts[:, None] + span]
        yield windows[:, :-1], windows[:, 1:]


# --------------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------------


class AttentionScores(nn.Module):
    """Raw attention logits ``(q @ k^T) * scale``, as a module so that traces can name it.

    The product is scaled *after* the matmul, as in most hand-written GPTs, so under float16 autocast the
    unscaled ``q @ k^T`` is what has to fit in float16's range (the matmul runs in float16).
    """

    def __init__(self, scale: float) -> None:
        """Store the ``1/sqrt(head_dim)`` factor."""
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Return ``(q @ k^T) * scale`` for ``q``, ``k`` of shape ``(batch, heads, time, head_dim)``."""
        return (q @ k.transpose(-2, -1)) * self.scale


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written out by hand.

    ``qkv`` projects to queries, keys and values at once, ``scores`` computes the attention logits
    (:class:`AttentionScores`), the causal mask and softmax follow, and ``proj`` maps the heads back to the
    model width.
    """

    def __init__(self, d_model: int, n_head: int, block_size: int) -> None:
        """Create the projections and the causal mask for sequences up to ``block_size`` tokens."""
        super().__init__()
        if d_model % n_head != 0:
            raise ValueError("d_model must be divisible by n_head")
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.scores = AttentionScores(1.0 / math.sqrt(self.head_dim))
        self.proj = nn.Linear(d_model, d_model)
        mask = torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape ``(batch, time, d_model)``; returns the same shape."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        scores = self.scores(q, k)
        mask: torch.Tensor = self.causal_mask  # type: ignore[assignment]
        scores = scores.masked_fill(mask[:t, :t], float("-inf"))
        weights = F.softmax(scores, dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(out)


class MLP(nn.Module):
    """Position-wise feed-forward network: ``fc`` (4x expansion), GELU, ``proj``."""

    def __init__(self, d_model: int) -> None:
        """Create the two Linear layers for model width ``d_model``."""
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x`` of shape ``(..., d_model)``."""
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """A transformer block with residual attention and MLP sub-layers.

    With ``norm=True`` it is a standard pre-LayerNorm block (``x + attn(ln1(x))``, ``x + mlp(ln2(x))``).
    With ``norm=False`` the LayerNorms are replaced by identities, so nothing bounds the scale of the
    residual stream: this is the fragile configuration used by the demo.
    """

    def __init__(self, d_model: int, n_head: int, block_size: int, norm: bool = True) -> None:
        """Create the block's sub-layers."""
        super().__init__()
        self.ln1: nn.Module = nn.LayerNorm(d_model) if norm else nn.Identity()
        self.attn = CausalSelfAttention(d_model, n_head, block_size)
        self.ln2: nn.Module = nn.LayerNorm(d_model) if norm else nn.Identity()
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` of shape ``(batch, time, d_model)``."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """A small decoder-only transformer over characters.

    Module names read well in a trace: ``tok_emb``, ``pos_emb``, ``blocks.<i>.attn.qkv``,
    ``blocks.<i>.attn.scores``, ``blocks.<i>.attn.proj``, ``blocks.<i>.mlp.fc``, ``blocks.<i>.mlp.proj``,
    ``ln_f`` and ``lm_head``.
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 64,
        d_model: int = 64,
        n_layer: int = 2,
        n_head: int = 4,
        norm: bool = True,
        final_norm: bool = True,
    ) -> None:
        """Create the model.

        ``norm=False`` removes the LayerNorms inside the blocks; ``final_norm=False`` removes ``ln_f``.
        """
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, block_size, norm) for _ in range(n_layer))
        self.ln_f: nn.Module = nn.LayerNorm(d_model) if final_norm else nn.Identity()
        self.lm_head = nn.Linear(d_model, vocab_size)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """GPT-2 style initialisation: N(0, 0.02) weights, zero biases."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Return next-character logits of shape ``(batch, time, vocab)`` for token ids ``idx``."""
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        positions = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# --------------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------------


@dataclass
class DemoConfig:
    """Settings for the demo run; the defaults overflow float16 in the forward pass within ~30 steps.

    Attributes:
        steps: number of optimizer steps to run.
        lr: peak Adam learning rate (deliberately too high by default), reached after ``warmup_steps``.
        warmup_steps: length of the linear learning-rate warmup, counted in optimizer updates (see
            :func:`warmup_lr`); ``0`` disables warmup.
        dtype: autocast dtype, ``"float16"`` or ``"bfloat16"``.
        seed: seed for model initialisation and batch sampling.
        device: torch device string, e.g. ``"cpu"`` or ``"cuda"``.
        batch_size: windows per batch.
        block_size: characters per window (and maximum context length).
        d_model: model width.
        n_layer: number of transformer blocks.
        n_head: attention heads per block.
        norm: LayerNorm inside the blocks (``True``: a healthy GPT-2 style model; ``False``: the fragile
            demo model).
        final_norm: keep the final LayerNorm ``ln_f`` before ``lm_head``.
        max_chars: corpus size in characters.
        init_scale: initial loss scale of the :class:`torch.amp.GradScaler`. The default ``2**20`` is
            larger than PyTorch's ``2**16`` (Megatron-LM starts at ``2**32``), so the scaler visibly backs
            off during the first steps, as it does in real runs.
    """

    steps: int = 50
    lr: float = 0.1
    warmup_steps: int = 50
    dtype: DType = "float16"
    seed: int = 0
    device: str = "cpu"
    batch_size: int = 16
    block_size: int = 64
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    norm: bool = False
    final_norm: bool = True
    max_chars: int = 300_000
    init_scale: float = 2.0**20

    @property
    def torch_dtype(self) -> torch.dtype:
        """The :class:`torch.dtype` named by :attr:`dtype`."""
        if self.dtype == "float16":
            return torch.float16
        if self.dtype == "bfloat16":
            return torch.bfloat16
        raise ValueError(f"unsupported dtype {self.dtype!r}; expected 'float16' or 'bfloat16'")


def warmup_lr(update: int, config: DemoConfig) -> float:
    """Learning rate for optimizer update number ``update`` (0-based): linear warmup to ``config.lr``."""
    if config.warmup_steps <= 0:
        return config.lr
    return config.lr * min(1.0, (update + 1) / config.warmup_steps)


def build(
    config: DemoConfig,
) -> tuple[CharGPT, torch.optim.Optimizer, torch.amp.GradScaler, Iterator[tuple[torch.Tensor, torch.Tensor]]]:
    """Create the model, optimizer, gradient scaler and batch iterator for ``config``.

    The model is initialised under ``torch.manual_seed(config.seed)`` and batches come from a generator
    seeded with the same value, so two runs that differ only in ``dtype`` see identical initial weights and
    identical batches.

    The :class:`~torch.amp.GradScaler` is enabled for float16, where it is required (small gradients would
    underflow without it), and disabled for bfloat16, which has float32's exponent range and needs no loss
    scaling: a disabled scaler's ``scale``/``step``/``update`` pass the loss and the step through unchanged, so
    both dtypes run the same :func:`train_step`.

    The optimizer is :class:`torch.optim.Adam` with a linear learning-rate warmup (:func:`warmup_lr`)
    installed as an optimizer step pre-hook: just before each real update the hook sets the group's ``lr``
    and advances its counter. Updates that the scaler skips (non-finite gradients) therefore do not advance
    the warmup, exactly like Adam's own step count. This keeps the training loop a plain
    ``train_step(...)`` call with no separate scheduler object; ``optimizer.param_groups[0]["lr"]`` always
    holds the rate of the most recent update.

    The batch iterator yields CPU tensors; :func:`train_step` moves them to the device.
    """
    torch.manual_seed(config.seed)
    ids, vocab = load_corpus(config.max_chars)
    device = torch.device(config.device)
    model = CharGPT(
        vocab_size=len(vocab),
        block_size=config.block_size,
        d_model=config.d_model,
        n_layer=config.n_layer,
        n_head=config.n_head,
        norm=config.norm,
        final_norm=config.final_norm,
    ).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=warmup_lr(0, config))
    updates = 0

    def apply_warmup(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Set the warmup learning rate for the update that is about to happen."""
        nonlocal updates
        for group in opt.param_groups:
            group["lr"] = warmup_lr(updates, config)
        updates += 1

    optimizer.register_step_pre_hook(apply_warmup)
    scaler = torch.amp.GradScaler(
        device.type, init_scale=config.init_scale, enabled=config.dtype == "float16"
    )
    generator = torch.Generator().manual_seed(config.seed)
    return model, optimizer, scaler, batches(ids, config.batch_size, config.block_size, generator)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
    dtype: torch.dtype | str,
    device: torch.device | str,
) -> torch.Tensor:
    """Run one standard mixed-precision training step and return the (detached) loss.

    ``zero_grad`` -> forward and cross-entropy under ``torch.autocast`` -> ``scaler.scale(loss).backward()``
    -> ``scaler.step(optimizer)`` (skipped by the scaler when gradients are not finite) ->
    ``scaler.update()``. ``dtype`` may be a :class:`torch.dtype` or ``"float16"``/``"bfloat16"``.
    """
    if isinstance(dtype, str):
        dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    device = torch.device(device)
    x = x.to(device)
    y = y.to(device)
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type=device.type, dtype=dtype):
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()
