"""Tracing overhead on small real architectures built from configs (nothing downloaded).

HF GPT-2, BERT and RoBERTa (``transformers`` config classes, 2 layers, d=128), and a ResNet-18 and a
ConvNeXt-like CNN built by hand (torchvision's CPU build is not available here, so timm cannot run). fp32,
AdamW, interleaved with untraced steps as in ``overhead.py`` (modes rotate each round). Prints the per-model
table, records/step and µs per record ((traced - untraced) / records), and the median ratio.

    python benchmarks/real_models.py --rounds 5 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import Mode, Workload, _no_ctx, bench_workload, machine_line, nantrace_mode


def _hf(name: str) -> Workload:
    import transformers as tf

    torch.manual_seed(0)
    # BERT and RoBERTa: the same encoder shape
    enc = dict(
        num_hidden_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        intermediate_size=512,
        vocab_size=1000,
        max_position_embeddings=128,
    )
    if name == "gpt2":
        model: nn.Module = tf.GPT2LMHeadModel(
            tf.GPT2Config(
                n_layer=2,
                n_embd=128,
                n_head=4,
                n_positions=128,
                vocab_size=1000,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    elif name == "bert":
        model = tf.BertForMaskedLM(tf.BertConfig(**enc))
    else:
        model = tf.RobertaForMaskedLM(tf.RobertaConfig(pad_token_id=1, **enc))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, 1000, (4, 64))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    return Workload(name, f"HF {name} 2x128", model, opt, None, step, torch.device("cpu"))


class _Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.b2(self.c2(self.relu(self.b1(self.c1(x))))) + self.down(x))


def resnet18(classes: int = 10) -> nn.Module:
    """ResNet-18 (BasicBlock, [2, 2, 2, 2], widths 64-512), as torchvision builds it."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for i, w in enumerate((64, 128, 256, 512)):
        layers += [_Basic(cin, w, 1 if i == 0 else 2), _Basic(w, w, 1)]
        cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


class _CNBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(d, d, 7, padding=3, groups=d)
        self.norm = nn.LayerNorm(d)
        self.pw1, self.act, self.pw2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(x).permute(0, 2, 3, 1)
        return x + self.pw2(self.act(self.pw1(self.norm(y)))).permute(0, 3, 1, 2)


def convnext_small(classes: int = 10) -> nn.Module:
    """ConvNeXt-like: stem 4x4/4, stages of depths (1, 1, 2, 1) and widths 48-384, downsampling 2x2/2."""
    dims, depths = (48, 96, 192, 384), (1, 1, 2, 1)
    layers: list[nn.Module] = [nn.Conv2d(3, dims[0], 4, 4)]
    for i, (d, n) in enumerate(zip(dims, depths, strict=True)):
        if i:
            layers.append(nn.Conv2d(dims[i - 1], d, 2, 2))
        layers += [_CNBlock(d) for _ in range(n)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(dims[-1], classes)]
    return nn.Sequential(*layers)


def _cnn(name: str) -> Workload:
    torch.manual_seed(0)
    model = resnet18() if name == "resnet18" else convnext_small()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return Workload(name, name, model, opt, None, step, torch.device("cpu"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps per mode per round (3)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", default="gpt2,bert,roberta,resnet18,convnext")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    modes = [Mode("none", _no_ctx), nantrace_mode("nantrace", {})]
    print("| model | untraced ms/step | traced ms/step | ratio | CPU-time ratio | records/step | µs/record |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    ratios = []
    for name in args.models.split(","):
        w = _hf(name) if name in ("gpt2", "bert", "roberta") else _cnn(name)
        res = {r.mode: r for r in bench_workload(w, modes, args.rounds, args.steps, 1, lambda s: None)}
        base, tr = res["none"], res["nantrace"]
        ratio = statistics.median(tr.ratio)
        ratios.append(ratio)
        recs = tr.records_per_step or 0.0
        extra = statistics.median(tr.ms) - statistics.median(base.ms)
        per = extra * 1e3 / recs if recs else float("nan")
        print(
            f"| {w.title} | {statistics.median(base.ms):.1f} | {statistics.median(tr.ms):.1f} | {ratio:.2f}× "
            f"| {statistics.median(tr.cpu_ratio):.2f}× | {recs:.0f} | {per:.0f} |",
            flush=True,
        )
    print(f"median ratio over {len(ratios)} architectures: {statistics.median(ratios):.2f}×")


if __name__ == "__main__":
    main()
