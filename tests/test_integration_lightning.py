"""nantrace.integrations.lightning.NanTraceCallback on a real lightning.pytorch.Trainer, on CPU.

Lightning 2.6 turns ``precision="16-mixed"`` into ``"bf16-mixed"`` on CPU, but accepts its fp16 plugin
``MixedPrecision("16-mixed", "cpu")`` there: fp16 autocast with a CPU GradScaler. The tests use that plugin,
with an init scale of 16 so that only the planted NaN overflows. 24 samples in batches of 4, in order; the
sample at index ``BAD`` holds a NaN, so the bad batch is optimizer step ``BAD // 4`` = 3.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nantrace

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from nantrace.integrations.lightning import NanTraceCallback  # noqa: E402

BAD = 13
BAD_STEP = BAD // 4


class Regressor(pl.LightningModule):
    """Linear(4, 4) → ReLU → Linear(4, 1), MSE loss, SGD; ``raise_at`` makes that batch's training_step fail;
    ``direct`` calls the submodule ``net`` instead of ``self(x)``."""

    def __init__(self, raise_at: int | None = None, direct: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        self.raise_at, self.direct = raise_at, direct
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.raise_at:
            raise RuntimeError("corrupt shard")
        x, y = batch
        loss = F.mse_loss(self.net(x) if self.direct else self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g)
    x[BAD, 2] = float("nan")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def fit(
    tmp_path: Path,
    cb: NanTraceCallback,
    module: Regressor,
    *,
    max_steps: int = 5,
    fp16: bool = True,
    accumulate: int = 1,
) -> tuple[Any, torch.amp.GradScaler | None]:
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0) if fp16 else None
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)] if fp16 else None,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        accumulate_grad_batches=accumulate,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
    )
    trainer.fit(module, loader())
    return trainer, scaler


def metrics(trainer: Any) -> list[dict[str, str]]:
    with open(Path(trainer.log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def hooks_left(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_always_called)
        for m in model.modules()
    )


def assert_data_fault(tr: nantrace.Trace | None, step: int = BAD_STEP, micro_step: int = 0) -> None:
    assert tr is not None
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.step, ov.micro_step, ov.phase, ov.module, ov.tensor, ov.kind) == (
        step,
        micro_step,
        "data",
        "",
        "input[0]",
        "nan",
    )


def test_fp16_plugin_bad_batch_is_a_data_fault_and_is_logged(tmp_path: Path) -> None:
    cb = NanTraceCallback(tensorboard=tmp_path / "tb")
    module = Regressor()
    trainer, scaler = fit(tmp_path, cb, module)
    assert isinstance(trainer.precision_plugin, MixedPrecision) and trainer.precision_plugin.scaler is scaler
    tr = cb.trace
    assert_data_fault(tr)
    assert tr is not None
    steps = tr.steps
    assert steps["step"].tolist() == [0, 1, 2, 3, 4]
    assert steps["scale"].tolist() == [16.0, 16.0, 16.0, 16.0, 8.0]
    assert steps["skipped"].tolist() == [False, False, False, True, False]
    # step 3: all 22 rows hold the NaN (data 1, forward 9, loss 2, backward 10; the skipped step has no
    # optimizer rows)
    assert steps["n_nonfinite"].tolist() == [0, 0, 0, 22, 0]
    assert steps["n_records"].iloc[BAD_STEP] == 22
    finite = [i for i in range(5) if i != BAD_STEP]
    assert steps["loss"].iloc[finite].tolist() == pytest.approx([module.losses[i] for i in finite], rel=1e-6)
    records = tr.records
    out = records[(records["module"] == "net.0") & (records["tensor"] == "output")]
    assert set(out["dtype"].astype(str)) == {"float16"}  # fp16 autocast was on
    rows = metrics(trainer)
    assert [(r["step"], r["loss_scale"], r["skipped"], r["n_nonfinite"]) for r in rows] == [
        ("0", "16.0", "0.0", "0.0"),
        ("1", "16.0", "0.0", "0.0"),
        ("2", "16.0", "0.0", "0.0"),
        ("3", "16.0", "1.0", "22.0"),
        ("4", "8.0", "0.0", "0.0"),
    ]
    saved = Path(trainer.log_dir) / "trace.nantrace"
    assert cb.saved_path == saved
    assert_data_fault(nantrace.load(saved))
    assert hooks_left(module) == 0
    assert scaler is not None and {"scale", "update"}.isdisjoint(vars(scaler))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("nantrace/n_nonfinite")] == [
        (0, 0.0),
        (1, 0.0),
        (2, 0.0),
        (3, 22.0),
        (4, 0.0),
    ]
    assert [(e.step, e.value) for e in ea.Scalars("nantrace/loss_scale")] == [
        (0, 16.0),
        (1, 16.0),
        (2, 16.0),
        (3, 16.0),
        (4, 8.0),
    ]


@pytest.mark.parametrize(("watch", "first"), [(True, "full"), (None, "watch")])
def test_watch_replays_the_bad_batch_and_names_the_same_data_fault(
    tmp_path: Path, watch: bool | None, first: str
) -> None:
    """watch=True (a full step every 100: step 0) and watch=None (no full step): the sentinel flags step 3's
    NaN input, the replay records it as trace does (22 non-finite rows), and training is bit-identical."""
    plain, traced = Regressor(), NanTraceCallback()
    fit(tmp_path / "traced", traced, plain)
    cb = NanTraceCallback(watch=watch)
    module = Regressor()
    trainer, _ = fit(tmp_path / "watched", cb, module)
    tr = cb.trace
    assert_data_fault(tr)
    assert tr is not None and traced.trace is not None
    fields = ("step", "micro_step", "phase", "module", "module_type", "call", "tensor", "kind")
    ours, theirs = tr.first_overflow(), traced.trace.first_overflow()
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]
    steps = tr.steps
    assert steps["recorded"].tolist() == [first, "watch", "watch", "replay", "watch"]
    assert steps["skipped"].tolist() == [False, False, False, True, False]
    assert steps["scale"].tolist() == [16.0, 16.0, 16.0, 16.0, 8.0]
    assert steps["n_nonfinite"].tolist() == [0, 0, 0, 22, 0]
    assert set(tr.records["step"]) == ({0, BAD_STEP} if first == "full" else {BAD_STEP})
    # bit-identical to the traced run (repr: exact, and NaN equals NaN): the replay changed nothing
    assert [repr(v) for v in module.losses] == [repr(v) for v in plain.losses]
    for a, b in zip(module.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    assert_data_fault(nantrace.load(Path(trainer.log_dir) / "trace.nantrace"))
    assert hooks_left(module) == 0


def test_gradient_accumulation_steps_are_optimizer_steps(tmp_path: Path) -> None:
    # accumulate_grad_batches=2: batches 2 and 3 form step 1, and sample 13 is in batch 3 (micro-step 1)
    cb = NanTraceCallback()
    trainer, _ = fit(tmp_path, cb, Regressor(), max_steps=3, accumulate=2)
    assert trainer.global_step == 3
    assert_data_fault(cb.trace, step=1, micro_step=1)
    assert cb.trace is not None
    assert cb.trace.steps["micro_steps"].tolist() == [2, 2, 2]
    assert cb.trace.steps["skipped"].tolist() == [False, True, False]
    assert [(r["step"], r["skipped"]) for r in metrics(trainer)] == [("0", "0.0"), ("1", "1.0"), ("2", "0.0")]


def test_stop_on_overflow_saves_and_stops(tmp_path: Path) -> None:
    cb = NanTraceCallback(stop_on_overflow=True)
    trainer, _ = fit(tmp_path, cb, Regressor(), max_steps=10)
    assert trainer.global_step == BAD_STEP + 1
    saved = nantrace.load(Path(trainer.log_dir) / "trace.nantrace")
    assert saved.steps["step"].tolist() == [0, 1, 2, 3]
    assert_data_fault(saved)
    assert [r["n_nonfinite"] for r in metrics(trainer)] == ["0.0", "0.0", "0.0", "22.0"]


def test_exception_detaches_and_saves(tmp_path: Path) -> None:
    path = tmp_path / "crash.nantrace"
    cb = NanTraceCallback(trace_path=path)
    module = Regressor(raise_at=2)
    with pytest.raises(RuntimeError, match="corrupt shard"):
        fit(tmp_path, cb, module)
    assert hooks_left(module) == 0
    assert cb.saved_path == path
    assert nantrace.load(path).steps["step"].tolist() == [0, 1]


def test_root_names_the_submodule_training_step_calls(tmp_path: Path) -> None:
    # 32-bit: no GradScaler, so the loss comes from on_before_backward and loss_scale is NaN
    with pytest.warns(UserWarning, match=r"without a call of the traced module's forward \(Regressor\)"):
        cb = NanTraceCallback()
        fit(tmp_path / "a", cb, Regressor(direct=True), fp16=False)
    assert cb.trace is not None
    assert cb.trace.steps["micro_steps"].tolist() == [0] * 5  # no root forward call was seen
    ov = cb.trace.first_overflow()  # so the NaN input looks made inside `net`, the wrong answer
    assert ov is not None and (ov.step, ov.phase, ov.module, ov.tensor) == (
        BAD_STEP,
        "forward",
        "net",
        "input[0]",
    )

    cb = NanTraceCallback(root="net")
    module = Regressor(direct=True)
    trainer, _ = fit(tmp_path / "b", cb, module, fp16=False)
    assert_data_fault(cb.trace)
    assert cb.trace is not None
    assert cb.trace.steps["loss"].iloc[:BAD_STEP].tolist() == pytest.approx(
        module.losses[:BAD_STEP], rel=1e-6
    )
    assert {r["loss_scale"] for r in metrics(trainer)} == {"nan"}
    assert sorted(set(cb.trace.records["module"].astype(str))) == ["", "0", "1", "2"]  # names under `net`


def test_trace_options_are_passed_on(tmp_path: Path) -> None:
    cb = NanTraceCallback(modules="net.0", phases=["data", "forward"], every=2)
    fit(tmp_path, cb, Regressor())
    assert cb.trace is not None
    assert cb.trace.options["every"] == 2
    records = cb.trace.records
    assert set(records["phase"].astype(str)) == {"data", "forward"}
    assert set(records["module"].astype(str)) == {"", "net.0"}  # the root always records its inputs/outputs
    assert_data_fault(cb.trace)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"root must be a submodule's qualified name \(str\) or None; got 3"):
        NanTraceCallback(root=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"stop_on_overflow must be True, False, or an int ≥ 1.*got -1"):
        NanTraceCallback(stop_on_overflow=-1)
    with pytest.raises(
        nantrace.NantraceError, match=r"root='model' names no submodule of Regressor; .*\['net'\]"
    ):
        fit(tmp_path, NanTraceCallback(root="model"), Regressor())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"every": 0},
            ValueError,
            r"every must be an int ≥ 1 \(record full statistics every N-th step\); got 0",
        ),
        ({"phases": ["fwd"]}, ValueError, r"phases= has unknown phase\(s\) 'fwd'; choose from \['data'"),
        ({"modules": 3}, TypeError, r"modules= must be a name glob \(str\).*; got int: 3"),
        ({"drill": "yes"}, TypeError, r"drill must be True or False; got 'yes'"),
        ({"sync_free": 1}, TypeError, r"sync_free must be True, False or None; got 1"),
    ],
)
def test_trace_options_are_checked_when_the_callback_is_made(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        NanTraceCallback(**kwargs)


def test_importing_nantrace_imports_no_lightning_and_a_missing_one_says_what_to_install() -> None:
    code = (
        "import sys, nantrace, nantrace.integrations\n"
        "print('lightning' in sys.modules)\n"
        "sys.modules['lightning'] = None\n"
        "try:\n"
        "    import nantrace.integrations.lightning\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        "False",
        'nantrace.integrations.lightning needs lightning: pip install "nantrace[lightning]"',
    ]
