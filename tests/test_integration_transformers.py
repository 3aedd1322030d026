"""nantrace.integrations.transformers.NanTraceCallback on a real transformers.Trainer, on CPU.

A tiny randomly initialised GPT-2 (no download) is fed ``inputs_embeds`` (floats, so the model's inputs are
recorded in phase ``data``) from an iterable dataset, in order; the sample at index ``BAD`` holds a NaN, so
with 2 samples per batch the bad batch is optimizer step ``BAD // 2`` = 3 (the Trainer's ``global_step`` 4).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import nantrace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from nantrace.integrations.transformers import NanTraceCallback  # noqa: E402

BAD = 6  # index of the sample holding a NaN: batch 3 with 2 samples per batch
BAD_STEP = BAD // 2
ADDED = {"loss_scale", "skipped", "n_nonfinite", "loss_unfiltered"}


class Embeds(torch.utils.data.IterableDataset):
    """12 samples of 8 positions × 16 features (GPT-2's n_embd), in a fixed order; ``raise_at`` raises there."""

    def __init__(self, raise_at: int | None = None) -> None:
        self.raise_at = raise_at

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(1)
        for i in range(12):
            if i == self.raise_at:
                raise RuntimeError("corrupt shard")
            e = torch.randn(8, 16, generator=g)
            if i == BAD:
                e[2, 3] = float("nan")
            yield {"inputs_embeds": e, "labels": torch.randint(0, 50, (8,), generator=g)}


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(cfg)


def trainer(
    tmp_path: Path,
    cb: transformers.TrainerCallback,
    *,
    max_steps: int = 5,
    logging_steps: int = 1,
    dataset: torch.utils.data.Dataset | None = None,
    extra: list[Any] | None = None,
    fp16: bool = False,
    accumulate: int = 1,
) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        max_steps=max_steps,
        per_device_train_batch_size=2,
        logging_steps=logging_steps,
        disable_tqdm=True,
        fp16=fp16,
        gradient_accumulation_steps=accumulate,
    )
    return transformers.Trainer(
        model=gpt2(), args=args, train_dataset=dataset or Embeds(), callbacks=[cb, *(extra or [])]
    )


def training_logs(t: Any) -> list[dict[str, Any]]:
    return [h for h in t.state.log_history if "loss" in h]


def hooks_left(model: torch.nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_always_called)
        for m in model.modules()
    )


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir))
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def assert_data_fault(tr: nantrace.Trace | None, step: int = BAD_STEP, micro_step: int = 0) -> None:
    assert tr is not None
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.step, ov.micro_step, ov.phase, ov.module, ov.tensor, ov.kind) == (
        step,
        micro_step,
        "data",
        "",
        "input.inputs_embeds",
        "nan",
    )


def test_planted_bad_batch_is_a_data_fault_and_the_logs_show_it(tmp_path: Path) -> None:
    cb = NanTraceCallback()
    t = trainer(tmp_path, cb)
    t.train()
    tr = cb.trace
    assert_data_fault(tr)
    assert tr is not None
    steps = tr.steps
    assert steps["step"].tolist() == [0, 1, 2, 3, 4]
    assert steps["micro_steps"].tolist() == [1] * 5
    nonfinite = steps["n_nonfinite"].tolist()
    assert nonfinite[:BAD_STEP] == [0, 0, 0] and min(nonfinite[BAD_STEP:]) > 0  # AdamW spreads the NaN on
    logs = training_logs(t)
    assert [h["step"] for h in logs] == [1, 2, 3, 4, 5]  # the Trainer's global_step = nantrace's step + 1
    for h, s in zip(logs, steps.itertuples(), strict=True):
        assert h.keys() >= ADDED
        assert math.isnan(h["loss_scale"])  # no GradScaler on CPU
        assert h["skipped"] == 0
        assert h["n_nonfinite"] == s.n_nonfinite
    for h in logs[:BAD_STEP]:
        assert h["loss_unfiltered"] == h["loss"]
        assert math.isfinite(h["loss"])
    for h in logs[BAD_STEP:]:
        assert h["loss"] == 0.0  # logging_nan_inf_filter hid the NaN loss...
        assert math.isnan(h["loss_unfiltered"])  # ...these columns do not
    assert steps["loss"].iloc[:BAD_STEP].tolist() == pytest.approx([h["loss"] for h in logs[:BAD_STEP]])
    summary = t.state.log_history[-1]
    assert "train_runtime" in summary and not (ADDED & summary.keys())  # the final summary gets no columns
    saved = tmp_path / "out" / "trace.nantrace"
    assert cb.saved_path == saved
    assert_data_fault(nantrace.load(saved))
    assert hooks_left(t.model) == 0


def test_fp16_grad_scaler_skip_shows_in_the_logs(tmp_path: Path) -> None:
    # On CPU accelerate runs fp16=True without autocast or GradScaler; give it the ones it uses on a GPU,
    # a GradScaler (init scale 16, so only the planted NaN overflows) and fp16 autocast, before train().
    cb = NanTraceCallback(tensorboard=tmp_path / "tb")
    t = trainer(tmp_path, cb, fp16=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    t.accelerator.scaler, t.accelerator.native_amp = scaler, True
    t.train()
    assert_data_fault(cb.trace)
    assert cb.trace is not None
    steps = cb.trace.steps
    assert steps["scale"].tolist() == [16.0, 16.0, 16.0, 16.0, 8.0]
    assert steps["skipped"].tolist() == [False, False, False, True, False]
    assert steps["n_nonfinite"].iloc[BAD_STEP] > 0
    assert steps["n_nonfinite"].drop(index=BAD_STEP).tolist() == [0, 0, 0, 0]  # the skip kept the weights
    records = cb.trace.records
    qkv = records[(records["module"] == "transformer.h.0.attn.c_attn") & (records["tensor"] == "output")]
    assert set(qkv["dtype"].astype(str)) == {"float16"}  # fp16 autocast was on
    logs = training_logs(t)
    assert [h["loss_scale"] for h in logs] == [16.0, 16.0, 16.0, 16.0, 8.0]
    assert [h["skipped"] for h in logs] == [0, 0, 0, 1, 0]
    assert [h["n_nonfinite"] for h in logs] == steps["n_nonfinite"].tolist()
    assert logs[BAD_STEP]["loss"] == 0.0 and math.isnan(logs[BAD_STEP]["loss_unfiltered"])
    assert logs[4]["loss_unfiltered"] == logs[4]["loss"]
    assert {"scale", "update"}.isdisjoint(vars(scaler))  # the GradScaler's patches are gone
    tb = tensorboard_scalars(tmp_path / "tb")
    assert tb["nantrace/loss_scale"] == [(0, 16.0), (1, 16.0), (2, 16.0), (3, 16.0), (4, 8.0)]
    assert tb["nantrace/skipped"] == [(0, 0.0), (1, 0.0), (2, 0.0), (3, 1.0), (4, 0.0)]
    assert tb["nantrace/nonfinite/loss"] == [(0, 0.0), (1, 0.0), (2, 0.0), (3, 1.0), (4, 0.0)]


def test_gradient_accumulation_steps_are_optimizer_steps(tmp_path: Path) -> None:
    # 2 micro-batches of 2 samples per optimizer step: sample 6 is in step 1, micro-step 1
    cb = NanTraceCallback()
    t = trainer(tmp_path, cb, max_steps=3, accumulate=2)
    t.train()
    assert_data_fault(cb.trace, step=1, micro_step=1)
    assert cb.trace is not None
    assert cb.trace.steps["micro_steps"].tolist() == [2, 2, 2]
    logs = training_logs(t)
    assert [h["step"] for h in logs] == [1, 2, 3]
    assert logs[0]["loss_unfiltered"] == logs[0]["loss"]
    assert math.isfinite(logs[1]["loss"]) and math.isnan(logs[1]["loss_unfiltered"])
    assert [h["n_nonfinite"] for h in logs] == cb.trace.steps["n_nonfinite"].tolist()
    assert logs[0]["n_nonfinite"] == 0 and logs[1]["n_nonfinite"] > 0


def test_stop_on_overflow_saves_then_stops(tmp_path: Path) -> None:
    seen: list[tuple[int, bool, bool]] = []

    class Probe(transformers.TrainerCallback):  # runs after NanTraceCallback in each event
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            saved = (tmp_path / "out" / "trace.nantrace").exists()
            seen.append((state.global_step, control.should_training_stop, saved))

    cb = NanTraceCallback(stop_on_overflow=True)
    t = trainer(tmp_path, cb, logging_steps=100, extra=[Probe()])
    t.train()
    assert seen == [(1, False, False), (2, False, False), (3, False, False), (4, True, True)]
    assert t.state.global_step == BAD_STEP + 1
    logs = training_logs(t)  # logging_steps=100: the only log is the one forced at the stop
    assert [h["step"] for h in logs] == [4]
    assert logs[0]["n_nonfinite"] > 0 and logs[0]["skipped"] == 0
    saved = nantrace.load(tmp_path / "out" / "trace.nantrace")
    assert saved.steps["step"].tolist() == [0, 1, 2, 3]
    assert_data_fault(saved)


def test_stop_after_consecutive_overflows(tmp_path: Path) -> None:
    cb = NanTraceCallback(stop_on_overflow=2)  # step 3 (data) and step 4 (NaN weights) both overflow
    t = trainer(tmp_path, cb, max_steps=8)
    t.train()
    assert t.state.global_step == BAD_STEP + 2
    assert cb.trace is not None
    assert cb.trace.steps["step"].tolist() == [0, 1, 2, 3, 4]


def test_train_that_raises_leaves_hooks_until_close_or_with(tmp_path: Path) -> None:
    # sample 8 is batch 4; accelerate's loader fetches one batch ahead, so train() raises during step 3
    trace_path = tmp_path / "custom" / "run.nantrace"
    cb = NanTraceCallback(trace_path=trace_path)
    t = trainer(tmp_path, cb, dataset=Embeds(raise_at=8))
    with pytest.raises(RuntimeError, match="corrupt shard"):
        t.train()
    assert hooks_left(t.model) > 0  # the Trainer calls no callback when train() raises
    assert cb.close() == trace_path
    assert hooks_left(t.model) == 0
    assert nantrace.load(trace_path).steps["step"].tolist() == [0, 1, 2]

    cb = NanTraceCallback(trace_path=trace_path)
    t = trainer(tmp_path, cb, dataset=Embeds(raise_at=8))
    with pytest.raises(RuntimeError, match="corrupt shard"), cb:
        t.train()
    assert hooks_left(t.model) == 0
    assert cb.saved_path == trace_path
    assert nantrace.load(trace_path).steps["step"].tolist() == [0, 1, 2]
    t.train_dataset = Embeds()  # a later train() with the same callback traces afresh
    t.train()
    assert_data_fault(cb.trace)
    assert hooks_left(t.model) == 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"stop_on_overflow must be True, False, or an int ≥ 1.*got 0"):
        NanTraceCallback(stop_on_overflow=0)
    with pytest.raises(ValueError, match=r"stop_on_overflow .* got 'yes'"):
        NanTraceCallback(stop_on_overflow="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"trace_path must be a str, an os.PathLike or None; got int: 3"):
        NanTraceCallback(trace_path=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"tensorboard must be a str, an os.PathLike or None; got bool: True"):
        NanTraceCallback(tensorboard=True)  # type: ignore[arg-type]


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


def test_importing_nantrace_imports_no_framework_and_a_missing_one_says_what_to_install() -> None:
    code = (
        "import sys, nantrace, nantrace.integrations\n"
        "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'tensorboard') if m in sys.modules))\n"
        "sys.modules['transformers'] = None\n"
        "try:\n"
        "    import nantrace.integrations.transformers\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "sys.modules['tensorboard'] = None\n"
        "from nantrace.integrations._common import check_tensorboard\n"
        "try:\n"
        "    check_tensorboard('runs')\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        "[]",
        'nantrace.integrations.transformers needs transformers: pip install "nantrace[transformers]"',
        "TensorBoard export needs the tensorboard package, which is not installed: "
        'pip install "nantrace[tensorboard]"',
    ]
