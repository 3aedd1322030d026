"""torch.distributed: every rank of a DDP (and FSDP2) job records its own trace, saves its part to the same path,
and the merged trace names the rank, step and layer that produced the first non-finite value.

Two processes are spawned once (``torch.multiprocessing``, spawn start method) on the gloo backend on CPU; inside
one process group they run every scenario in turn, each a fresh DDP model of the same tiny purpose-built net
under float16 autocast with a GradScaler, and save to a folder per scenario. The tests then load those folders
in this process and check exact answers.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import SqrtBetween
from torch import nn

import nantrace
from nantrace._naming import module_names

WORLD = 2
STEPS = 4
ROOT = Path(__file__).resolve().parents[1]


class Net(nn.Module):
    """fc1 (weights 0.5, so a batch of 3e4 overflows float16 in its output: 4 * 0.5 * 3e4 = 6e4 + ...) → ReLU →
    fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)
        with torch.no_grad():
            self.fc1.weight.fill_(0.5)
            self.fc1.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def batch(rank: int, step: int, scenario: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(3, 4, generator=g)
    if scenario == "nan_data" and rank == 1 and step == 2:
        x[0, 0] = float("nan")
    if scenario == "fwd_overflow" and rank == 0 and step == 1:
        x = torch.full((3, 4), 4.0e4)  # finite in float16 (max 65504); fc1 output 4 * 0.5 * 4e4 = 8e4 is not
    return x


def run(
    rank: int, scenario: str, out: Path, live_every: int | None = None, stream: Path | None = None
) -> nantrace.Trace:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net())
    if scenario == "compress":  # all-reduce in float16: gradients above 2 * 65504 overflow in the reduction
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        model.register_comm_hook(None, fp16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    with nantrace.trace(
        model, scaler=scaler, optimizer=opt, live_every=live_every, path=stream, flush_every=2
    ) as tr:
        for step in range(STEPS):
            x = batch(rank, step, scenario)
            with torch.autocast("cpu", dtype=torch.float16, enabled=scenario != "compress"):
                y = model(x)  # "compress" runs in float32, so that only the float16 reduction can overflow
            loss = y.float().pow(2).mean()
            if scenario == "compress" and step == 1:
                loss = loss * 1e6  # finite float32 gradients on every rank, too large for float16
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    tr.save(out / scenario)
    return tr


def sharded(model: nn.Module) -> nn.Module:
    """FSDP2 on gloo: ``fully_shard`` on ``fc1``, ``fc2`` and the root, over a mesh of every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for m in (model.fc1, model.fc2, model):
        fully_shard(m, mesh=mesh)
    return model


def run_fsdp2(rank: int, out: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = sharded(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nantrace.trace(model, optimizer=opt) as tr:
        for step in range(2):
            x = batch(rank, step, "nan_data")
            if rank == 1 and step == 1:
                x[1, 2] = float("nan")
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    tr.save(out / "fsdp2")
    return {"names": [n for n, _ in module_names(model)]}


def run_own_nan(rank: int, out: Path) -> dict[str, Any]:
    """FSDP2; at step 1 rank 1's batch (0.25: fc1 gives 0.5) makes NaN in the root's own code, rank 0's (2: fc1
    gives 4) does not. A replay of the root on rank 1 alone would all-gather with no partner: nantrace must not
    replay it, under trace (drill-down) or watch (step replay)."""
    got: dict[str, Any] = {}
    for name, make in (("trace", nantrace.trace), ("watch", nantrace.watch)):
        torch.manual_seed(0)
        model = sharded(SqrtBetween(weight=0.5, shift=1.0))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with make(model, optimizer=opt) as tr:
            for step in range(2):
                x = torch.full((2, 4), 0.25 if rank == 1 and step == 1 else 2.0)
                loss = model(x).sum()
                opt.zero_grad()
                tr.step(loss=loss)
                loss.backward()
                opt.step()
        ov = tr.first_overflow()
        got[name] = {
            "first": None if ov is None else [ov.step, ov.phase, ov.module, ov.tensor, ov.kind, str(ov)],
            "ops": len(tr.ops),
            "recorded": tr.steps["recorded"].astype(str).tolist(),
        }
    return got


class AllReduceThenSqrt(SqrtBetween):
    """A tensor-parallel style root: its own code all-reduces a count before the sqrt of :class:`SqrtBetween`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = torch.ones(1)
        dist.all_reduce(n)  # every rank adds 1: n = 2
        return self.fc2(torch.sqrt(self.fc1(x) - self.shift) * (n / 2))


def run_all_reduce(rank: int) -> dict[str, Any]:
    """No FSDP/DDP module; at step 1 rank 1's batch makes NaN in the root's own code after its all-reduce. The
    drill-down's replay of the root on rank 1 stops at the collective (``NoCollectives``) instead of waiting for
    rank 0."""
    torch.manual_seed(0)
    model = AllReduceThenSqrt(weight=0.5, shift=1.0)
    with nantrace.trace(model) as tr:
        for step in range(2):
            model(torch.full((2, 4), 0.25 if rank == 1 and step == 1 else 2.0)).sum().backward()
            tr.step()
    ov = tr.first_overflow()
    return {
        "first": None if ov is None else [ov.step, ov.phase, ov.module, ov.tensor, ov.kind],
        "ops": len(tr.ops),
    }


def run_fsdp1(rank: int, out: Path) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        Net(),
        device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        use_orig_params=True,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nantrace.trace(model, optimizer=opt) as tr:
        for step in range(2):
            x = batch(rank, step, "healthy")
            if rank == 1 and step == 1:
                x[2, 0] = float("nan")
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    tr.save(out / "fsdp1")
    return {
        "wrapped": [n for n, _ in model.named_modules()],
        "names": [n for n, _ in module_names(model)],
    }


def worker(rank: int, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        folder = Path(out)
        info: dict[str, Any] = {}
        for scenario in ("nan_data", "fwd_overflow", "compress"):
            tr = run(rank, scenario, folder)
            info[scenario] = {"rank": tr.rank, "world_size": tr.world_size}
            if scenario == "nan_data":
                tr.save(folder / "stale")  # the earlier run, saved by every rank ...
        healthy = run(rank, "healthy", folder, stream=folder / "healthy_stream")
        if rank == 0:
            healthy.save(folder / "stale")  # ... then a healthy run into the same path, rank 1 not saving
        info["run_id"] = {
            "nan_data": info_run_id(folder / "nan_data", rank),
            "healthy": healthy._view().meta.run_id,
        }
        live = run(rank, "nan_data", folder / "live", live_every=2)
        info["live"] = live.live_reports
        info["live_checks"] = live._live.checks if live._live is not None else None
        info["fsdp2"] = run_fsdp2(rank, folder)
        info["fsdp1"] = run_fsdp1(rank, folder)
        info["own_nan"] = run_own_nan(rank, folder)
        info["all_reduce"] = run_all_reduce(rank)
        (folder / f"info-{rank}.json").write_text(json.dumps(info))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def info_run_id(folder: Path, rank: int) -> str:
    from nantrace._format import read_header

    return str(read_header(folder / f"rank-{rank:05d}-of-{WORLD:05d}.nantrace")["run_id"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    (out / "live").mkdir()
    mp.start_processes(worker, args=(free_port(), str(out)), nprocs=WORLD, start_method="spawn")
    return out


def info(runs: Path, rank: int) -> dict[str, Any]:
    return dict(json.loads((runs / f"info-{rank}.json").read_text()))


# ------------------------------------------------------------------------------------------------ (1) data NaN
def test_nan_in_rank1_batch_is_a_data_fault_of_rank1_and_received_by_rank0(runs: Path) -> None:
    assert sorted(p.name for p in (runs / "nan_data").iterdir()) == [
        "rank-00000-of-00002.nantrace",
        "rank-00001-of-00002.nantrace",
    ]
    tr = nantrace.load(runs / "nan_data")
    assert (tr.rank, tr.world_size, tr.ranks) == (None, 2, [0, 1])
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.rank, ov.step, ov.micro_step, ov.phase, ov.module, ov.tensor, ov.kind, ov.propagated) == (
        1,
        2,
        0,
        "data",
        "",
        "input[0]",
        "nan",
        False,
    )
    assert (
        str(ov).splitlines()[0]
        == "step 2 data: model input `input[0]` held NaN before any module ran (float32)"
    )
    assert " ".join(str(ov).splitlines()[1:]).startswith(
        "Rank 1 of 2 produced it. At step 2 the model input `input[0]` already held 1 NaN"
    )
    assert str(ov).endswith(
        "Rank 0 only received it through the gradient reduction (propagated, not produced)."
    )
    # every step once, by its cross-rank producer
    ovs = tr.overflows()
    assert ovs[["step", "rank", "phase", "module", "propagated"]].values.tolist() == [
        [2, 1, "data", "", False]
    ]
    # per rank: rank 0 holds NaN only in its gradients after DDP's all-reduce
    per = tr.overflows(per_rank=True)
    assert per[["step", "rank", "phase", "module", "tensor", "kind", "propagated"]].values.tolist() == [
        [2, 0, "backward", "fc1", "weight.grad", "nan", True],  # reduced rows are recorded in parameter order
        [2, 1, "data", "", "input[0]", "nan", False],
    ]
    rec = tr.records
    r0 = rec[(rec["rank"] == 0) & (rec["step"] == 2)]
    bad = r0[(r0["n_nan"] + r0["n_posinf"] + r0["n_neginf"]) > 0]
    assert bad["reduced"].all() and bad["phase"].astype(str).eq("backward").all()
    assert sorted(bad["module"].astype(str) + "." + bad["tensor"].astype(str)) == [
        "fc1.bias.grad",
        "fc1.weight.grad",
        "fc2.bias.grad",
        "fc2.weight.grad",
    ]
    # the local parameter gradients of rank 0 at step 2 were finite; the reduced ones are one row per parameter
    local_grads = r0[~r0["reduced"] & r0["tensor"].astype(str).str.endswith(".grad")]
    assert len(local_grads) == 4 and int(local_grads["n_nan"].sum()) == 0
    assert len(rec[rec["reduced"]]) == WORLD * STEPS * 4
    # the scaler skipped step 2 on both ranks (the reduced gradients are the same everywhere)
    st = tr.steps
    assert st[["step", "rank"]].values.tolist() == [[s, r] for s in range(STEPS) for r in range(WORLD)]
    assert st.loc[st["skipped"].astype(bool), ["step", "rank"]].values.tolist() == [[2, 0], [2, 1]]
    d = tr.diagnose()
    assert d.cause == "data" and d.overflow is not None and d.overflow.rank == 1
    assert d.summary.startswith("Rank 1: ")


def test_rank_names_unwrapped_and_each_part_knows_its_rank(runs: Path) -> None:
    assert info(runs, 0)["nan_data"] == {"rank": 0, "world_size": 2}
    assert info(runs, 1)["nan_data"] == {"rank": 1, "world_size": 2}
    tr = nantrace.load(runs / "nan_data")
    rec = tr.records
    for r in range(WORLD):
        names = sorted(set(rec.loc[rec["rank"] == r, "module"].astype(str)))
        assert names == ["", "act", "fc1", "fc2"]
    root = rec[(rec["module"].astype(str) == "") & (rec["phase"].astype(str) != "loss")]
    assert set(root["module_type"].astype(str)) == {"Net"}
    # one rank's part alone: that rank only received the NaN, and does not claim to have produced it
    part0 = nantrace.load(runs / "nan_data" / "rank-00000-of-00002.nantrace")
    assert (part0.rank, part0.world_size, part0.ranks) == (0, 2, [0])
    ov0 = part0.first_overflow()
    assert ov0 is not None
    assert (ov0.rank, ov0.step, ov0.phase, ov0.module, ov0.tensor, ov0.propagated) == (
        0,
        2,
        "backward",
        "fc1",
        "weight.grad",
        True,
    )
    assert "rank 0 received it and did not produce it" in str(ov0)
    # its diagnosis says so too (the scaler skipped the step, but that is no benign backoff of rank 0's own)
    for d0 in (part0.diagnose(), tr.rank_view(0).diagnose()):
        assert d0.cause == "received" and d0.overflow == ov0 and not d0.ok
        assert d0.summary == (
            "Rank 0 received nan at step 2 through the gradient reduction from another rank; this rank's trace "
            "alone cannot say what produced it."
        )
        assert d0.advice[0].startswith("Load the folder all ranks saved to (`nantrace.load(folder)`")
    part1 = nantrace.load(runs / "nan_data" / "rank-00001-of-00002.nantrace")
    ov1 = part1.first_overflow()
    assert ov1 is not None and (ov1.rank, ov1.phase, ov1.propagated) == (1, "data", False)


# ------------------------------------------------------------------------------------------------ stale parts
def test_every_rank_shares_one_run_id_per_recording(runs: Path) -> None:
    ids0, ids1 = info(runs, 0)["run_id"], info(runs, 1)["run_id"]
    assert ids0 == ids1  # rank 0's uuid, broadcast when the trace was created
    assert len(ids0["nan_data"]) == 32 and ids0["nan_data"] != ids0["healthy"]
    tr = nantrace.load(runs / "nan_data")
    assert tr.header["run_id"] == ids0["nan_data"]
    assert (
        nantrace.load(runs / "nan_data" / "rank-00001-of-00002.nantrace").header["run_id"] == ids0["nan_data"]
    )


def test_parts_left_over_from_an_earlier_run_are_ignored_with_a_warning(runs: Path) -> None:
    """A NaN run saved by both ranks, then a healthy run into the same path where rank 1 did not save: the
    merged trace is the healthy run's rank 0, not the earlier run's NaN on rank 1."""
    ids = info(runs, 0)["run_id"]
    with pytest.warns(UserWarning) as got:
        tr = nantrace.load(runs / "stale")
    texts = [str(w.message) for w in got]
    assert len(texts) == 2
    assert texts[0].startswith(
        f"{str(runs / 'stale')!r} holds parts of 2 runs: loading the newest, run {ids['healthy']} (saved "
    )
    assert (
        "ignoring 1 part(s) left over from another run: rank-00001-of-00002.nantrace (run "
        f"{ids['nan_data']}, saved "
    ) in texts[0]
    assert "holds 1 of 2 rank parts; ranks [1] are missing" in texts[1]
    assert tr.ranks == [0] and tr.header["run_id"] == ids["healthy"]
    assert tr.first_overflow() is None
    assert tr.diagnose().cause == "healthy"
    assert len(tr.steps) == STEPS and not tr.steps["skipped"].astype(bool).any()


def test_a_part_copied_from_another_run_is_ignored(runs: Path, tmp_path: Path) -> None:
    ids = info(runs, 0)["run_id"]
    d = tmp_path / "copied"
    d.mkdir()
    for scenario, rank in (("healthy", 0), ("nan_data", 1)):  # the NaN run was saved before the healthy one
        name = f"rank-{rank:05d}-of-00002.nantrace"
        (d / name).write_bytes((runs / scenario / name).read_bytes())
    tr, texts = _load_warned(d)
    assert len(texts) == 2 and "holds 1 of 2 rank parts; ranks [1] are missing" in texts[1]
    assert (
        "ignoring 1 part(s) left over from another run: rank-00001-of-00002.nantrace (run " + ids["nan_data"]
    ) in texts[0]
    assert tr.ranks == [0] and tr.first_overflow() is None
    # the newest run wins, whichever rank it is
    (d / "rank-00000-of-00002.nantrace").write_bytes(
        (runs / "nan_data" / "rank-00000-of-00002.nantrace").read_bytes()
    )
    (d / "rank-00001-of-00002.nantrace").write_bytes(
        (runs / "healthy" / "rank-00001-of-00002.nantrace").read_bytes()
    )
    tr, texts = _load_warned(d)
    assert "left over from another run: rank-00000-of-00002.nantrace (run " + ids["nan_data"] in texts[0]
    assert "ranks [0] are missing" in texts[1]
    assert tr.ranks == [1] and tr.first_overflow() is None


def _load_warned(folder: Path) -> tuple[nantrace.Trace, list[str]]:
    with pytest.warns(UserWarning) as got:
        tr = nantrace.load(folder)
    return tr, [str(w.message) for w in got]


def test_files_written_without_run_id_still_load(runs: Path, tmp_path: Path) -> None:
    """A header without ``run_id``/``saved_at`` (older nantrace): a single-process file loads; in a folder such a
    part counts as one run saved at its file's modification time."""
    import pyarrow.parquet as pq

    def strip(src: Path, dst: Path) -> None:
        table = pq.read_table(src)
        meta = dict(table.schema.metadata)
        footer = json.loads(meta[b"nantrace"])
        del (
            footer["header"]["run_id"],
            footer["header"]["saved_at"],
            footer["sha256"],
        )  # as older nantrace wrote
        meta[b"nantrace"] = json.dumps(footer).encode()
        pq.write_table(table.replace_schema_metadata(meta), dst)

    m = Net()
    with nantrace.trace(m) as one:
        m(torch.full((2, 4), 2e38))
    strip(one.save(tmp_path / "one.nantrace"), tmp_path / "old.nantrace")
    old = nantrace.load(tmp_path / "old.nantrace")
    assert "run_id" not in old.header and old.first_overflow() == one.first_overflow()
    d = tmp_path / "mixed"
    d.mkdir()
    strip(runs / "nan_data" / "rank-00001-of-00002.nantrace", d / "rank-00001-of-00002.nantrace")
    os.utime(d / "rank-00001-of-00002.nantrace", (0, 0))  # saved in 1970
    (d / "rank-00000-of-00002.nantrace").write_bytes(
        (runs / "healthy" / "rank-00000-of-00002.nantrace").read_bytes()
    )
    tr, texts = _load_warned(d)
    assert "rank-00001-of-00002.nantrace (a run without run id, saved 1970-01-01 00:00:00 UTC)" in texts[0]
    assert "ranks [1] are missing" in texts[1]
    assert tr.ranks == [0] and tr.first_overflow() is None


def test_merged_diagnosis_of_a_received_value_names_the_producer_or_passes_a_backoff(runs: Path) -> None:
    """The rule diagnose_merged applies to the rank it reads: a received value whose producer (the merged
    event of that step) is another rank's fault is ``received`` naming that rank; one whose producer was a
    scale-dependent backward overflow is passed over as that rank's loss-scale backoff."""
    from dataclasses import replace

    from nantrace._diagnose import _diagnose

    tr = nantrace.load(runs / "nan_data")
    ov = tr.first_overflow()
    assert ov is not None and (ov.rank, ov.step, ov.phase) == (1, 2, "data")
    d = _diagnose(tr.rank_view(0)._view(), [ov])
    assert d.cause == "received" and d.overflow is not None and d.overflow.rank == 0
    assert d.summary == "Rank 0 received nan at step 2 through the gradient reduction; rank 1 produced it."
    assert d.evidence[-1] == (
        "the merged trace names rank 1 as the producer: data, the model inputs, nan in `input[0]`"
    )
    assert d.advice == ["Diagnose the producing rank: `tr.rank_view(1).diagnose()`."]
    backoff = replace(
        ov, phase="backward", module="fc1", module_type="Linear", tensor="weight.grad", kind="inf"
    )
    assert (
        _diagnose(tr.rank_view(0)._view(), [backoff]).cause == "scaler_backoff"
    )  # step 2 skipped, step 3 trained


# ------------------------------------------------------------------------------------------------ (2) forward
def test_forward_overflow_on_rank0_only(runs: Path) -> None:
    tr = nantrace.load(runs / "fwd_overflow")
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.rank, ov.step, ov.phase, ov.module, ov.module_type, ov.tensor, ov.kind, ov.dtype) == (
        0,
        1,
        "forward",
        "fc1",
        "Linear",
        "output",
        "inf",
        "float16",
    )
    per = tr.overflows(per_rank=True)
    assert per[["step", "rank", "phase", "propagated"]].values.tolist() == [
        [1, 0, "forward", False],
        [1, 1, "backward", True],
    ]
    assert tr.diagnose().cause == "forward_overflow"


def test_overflow_made_by_the_reduction_itself(runs: Path) -> None:
    """DDP's float16 compression hook: every rank's local gradients are finite float32, the reduced ones +inf."""
    from nantrace._fmt import num as _g  # the number format of the diagnosis text

    tr = nantrace.load(runs / "compress")
    rec = tr.records
    step1 = rec[rec["step"] == 1]
    bad = step1[(step1["n_posinf"] + step1["n_neginf"] + step1["n_nan"]) > 0]
    assert len(bad) and bad["reduced"].all()
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.rank, ov.step, ov.phase, ov.module, ov.tensor, ov.kind, ov.propagated) == (
        0,
        1,
        "backward",
        "fc1",
        "weight.grad",
        "inf",
        False,
    )
    assert "the reduction itself produced it" in str(ov)
    # per rank: the rank the merged answer names is the producer, the other received it
    per = tr.overflows(per_rank=True)
    assert per[["step", "rank", "propagated"]].values.tolist() == [[1, 0, False], [1, 1, True]]
    assert per["message"][0] == str(ov)
    # diagnose() agrees with first_overflow(): the reduction overflowed, not the (float32, unautocast) backward
    d = tr.diagnose()
    assert d.cause == "backward_overflow" and d.overflow == ov and d.overflow.propagated is False
    assert d.summary == (
        "Rank 0: The gradient reduction overflowed at step 1: every rank's local gradients were finite, the "
        "reduced `weight.grad` of `fc1` was inf (e.g. float16 gradient compression)."
    )
    local = rec[(rec["step"] == 1) & (rec["rank"] == 0) & ~rec["reduced"]]
    w = local[(local["module"].astype(str) == "fc1") & (local["tensor"].astype(str) == "weight.grad")]
    assert len(w) == 1 and 65504 < float(w["absmax"].iloc[0]) < 3e38
    assert d.evidence[1].startswith(
        "at step 1 every rank's local gradients were finite; on rank 0 the local `weight.grad` of `fc1` had "
        f"absmax {_g(float(w['absmax'].iloc[0]))} ("
    )
    assert "still multiplied by the loss scale 256" in d.evidence[1]
    assert d.advice[0].startswith("Use bfloat16 compression (`bf16_compress_hook`")
    assert not any("autocast" in a or "keep `fc1` in float32" in a.lower() for a in d.advice)
    # one rank's part alone cannot tell: received, and diagnose() says so
    part = nantrace.load(runs / "compress" / "rank-00001-of-00002.nantrace")
    ov1 = part.first_overflow()
    assert ov1 is not None and (ov1.rank, ov1.propagated) == (1, True)
    d1 = part.diagnose()
    assert (d1.cause, d1.overflow) == ("received", ov1)


# ------------------------------------------------------------------------------------------------ (3) healthy
def test_healthy_run_reports_nothing(runs: Path) -> None:
    tr = nantrace.load(runs / "healthy")
    assert tr.first_overflow() is None
    assert len(tr.overflows()) == 0 and len(tr.overflows(per_rank=True)) == 0
    assert not tr.steps["skipped"].astype(bool).any()
    assert tr.diagnose().cause == "healthy"
    # grad_norm is of the reduced gradients: the same on both ranks of a step
    st = tr.steps
    norms = st.pivot(index="step", columns="rank", values="grad_norm")
    assert norms[0].tolist() == pytest.approx(norms[1].tolist(), rel=1e-6)
    # the same run streamed with trace(path=...): each rank streamed its own part into the folder
    streamed = nantrace.load(runs / "healthy_stream")
    assert streamed.ranks == [0, 1]
    assert len(streamed.records) == len(tr.records) and streamed.first_overflow() is None
    assert streamed.records["reduced"].sum() == tr.records["reduced"].sum() == WORLD * STEPS * 4


# ------------------------------------------------------------------------------------------------ report, live
def test_report_names_the_rank(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nantrace.cli import main

    assert main(["report", str(runs / "nan_data")]) == 1
    out = capsys.readouterr().out
    assert "ranks: 0, 1 of world size 2" in out
    assert "first overflow: rank 1, step 2, data, module `` (Net), nan" in out
    assert main(["report", str(runs / "healthy")]) == 0
    capsys.readouterr()
    assert main(["report", str(runs / "nan_data" / "rank-00000-of-00002.nantrace")]) == 1
    out = capsys.readouterr().out
    assert "rank: 0 of world size 2 (this rank's part only)" in out
    assert (
        "first overflow: rank 0, step 2, backward, module `fc1` (Linear), nan (received through the gradient "
        "reduction, not produced here)"
    ) in out
    tr = nantrace.load(runs / "nan_data")
    assert repr(tr).startswith("<nantrace.Trace of Net (in DistributedDataParallel): 4 steps, ")


def test_report_repr_and_plots_count_each_step_once_and_name_the_rank(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nantrace import plot
    from nantrace._report import summary_lines
    from nantrace.cli import main

    tr = nantrace.load(runs / "nan_data")
    # step 2 was skipped on both ranks: one skipped step of 4, not 2 of 8
    assert repr(tr).startswith(
        f"<nantrace.Trace of Net (in DistributedDataParallel): 4 steps, {len(tr.records)} records, 1 skipped"
    )
    assert main(["report", str(runs / "nan_data")]) == 1
    out = capsys.readouterr().out
    assert "summary of rank 1\nsteps: 4, records: " in out and "skipped steps (1): 2\n" in out
    # the summary of a merged trace itself: each step once, loss and scale of the lowest rank
    assert summary_lines(tr)[:3] == [
        f"steps: 4, records: {len(tr.records)}",
        "loss scale (rank 0): 256 (steps 0-2, 1 skipped) → 128 (step 3)",
        "skipped steps (1): 2",
    ]
    fig = plot.overview(tr.records, tr.steps)
    heat, timeline = fig.axes[0], fig.axes[1]
    assert heat.get_title(loc="left").endswith(
        "(ranks 0, 1 merged);\nrank 1 produced the first overflow: step 2, data, the model inputs"
    )
    assert "first non-finite value at step 2 in " in heat.get_title(loc="left")
    lines = {a.get_gid(): a for ax in fig.axes for a in ax.get_lines() if a.get_gid()}
    st = tr.steps
    for rank, gid in ((0, "loss"), (1, "loss_rank1")):  # one loss line per rank, not one zig-zag line
        assert lines[gid].get_xdata().tolist() == list(range(STEPS))
        want = st.loc[st["rank"] == rank, "loss"].to_numpy()
        assert np.array_equal(lines[gid].get_ydata(), want, equal_nan=True)
        assert lines[gid].get_label() == f"loss, rank {rank}"
    assert lines["scale"].get_xdata().tolist() == list(range(STEPS))
    assert lines["skipped"].get_xdata().tolist() == [2.0]
    assert timeline.get_title(loc="left").startswith("Loss scale (rank 0, the same on every rank)")


def test_live_mode_rank0_learns_the_producing_rank(runs: Path) -> None:
    """live_every=2 over 4 steps: two all-gathers (after steps 1 and 3); the second sees step 2's NaN."""
    line = "nantrace: rank 1 produced NaN in the model inputs at step 2 (data)"
    assert info(runs, 0)["live"] == [line]
    assert info(runs, 1)["live"] == [line]  # every rank gathers the same flags; only rank 0 prints
    assert info(runs, 0)["live_checks"] == 2
    tr = nantrace.load(runs / "live" / "nan_data")
    assert tr.header["options"]["live_every"] == 2


# ------------------------------------------------------------------------------------------------ FSDP2
def test_fsdp2_fully_shard_on_gloo(runs: Path) -> None:
    assert info(runs, 0)["fsdp2"]["names"] == ["", "fc1", "act", "fc2"]
    tr = nantrace.load(runs / "fsdp2")
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.rank, ov.step, ov.phase, ov.module, ov.tensor, ov.kind) == (
        1,
        1,
        "data",
        "",
        "input[0]",
        "nan",
    )
    rec = tr.records
    # FSDP2 parameters are DTensors: their gradients arrive reduce-scattered (rows marked reduced), each
    # rank's shard: fc1.weight (8, 4) is split into (4, 4) per rank
    grads = rec[rec["tensor"].astype(str).str.endswith(".grad")]
    assert grads["reduced"].all()
    w = grads[(grads["module"].astype(str) == "fc1") & (grads["tensor"].astype(str) == "weight.grad")]
    assert set(w["shape"].astype(str)) == {"(4, 4)"}
    per = tr.overflows(per_rank=True)
    assert per[["step", "rank", "phase", "propagated"]].values.tolist() == [
        [1, 0, "backward", True],
        [1, 1, "data", False],
    ]


def test_a_rank_alone_never_replays_a_call_that_issues_collectives(runs: Path) -> None:
    """FSDP2, a NaN made by the root's own code on rank 1 only (:func:`run_own_nan`). Replaying the root on rank 1
    alone would all-gather with no partner (the job hangs): nantrace.trace names the root from its rows with no
    op-level replay, and nantrace.watch does not replay the step and says why."""
    got = info(runs, 1)["own_nan"]
    trace, watch = got["trace"], got["watch"]
    assert trace["first"][:5] == [1, "forward", "", "input[0]", "nan"]
    assert trace["ops"] == 0
    assert watch["first"][:5] == [1, "forward", "", "output", "nan"]
    assert watch["ops"] == 0
    assert watch["recorded"] == ["full", "not_replayed"]  # every=100: step 0 is recorded in full
    assert trace["recorded"] == ["full", "full"]
    assert watch["first"][5] == (
        "nantrace.watch saw nan at step 1 (micro-step 0, forward: output of the model), but did not replay the step: "
        "the model holds FSDP or DDP modules, whose forward and backward issue collectives that the other ranks "
        "would never join, so its producer is unknown: this is where the sentinel detected it. Trace that step "
        "with nantrace.trace() on every rank to name the producer."
    )


def test_a_replay_stops_at_a_collective_of_the_users_own_code(runs: Path) -> None:
    """A root whose own code calls ``dist.all_reduce`` (:func:`run_all_reduce`), NaN on rank 1 only: the replay
    stops at the collective, so no op is named and rank 0 is not left waiting; the rows still name the root."""
    assert info(runs, 1)["all_reduce"] == {"first": [1, "forward", "", "input[0]", "nan"], "ops": 0}
    assert info(runs, 0)["all_reduce"] == {"first": None, "ops": 0}


def test_fsdp1_on_gloo(runs: Path) -> None:
    got = info(runs, 0)["fsdp1"]
    assert got["wrapped"] == [
        "",
        "_fsdp_wrapped_module",
        "_fsdp_wrapped_module.fc1",
        "_fsdp_wrapped_module.fc1._fsdp_wrapped_module",
        "_fsdp_wrapped_module.act",
        "_fsdp_wrapped_module.fc2",
        "_fsdp_wrapped_module.fc2._fsdp_wrapped_module",
    ]
    assert got["names"] == ["", "fc1", "act", "fc2"]
    tr = nantrace.load(runs / "fsdp1")
    assert sorted(set(tr.records["module"].astype(str))) == ["", "act", "fc1", "fc2"]
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.rank, ov.step, ov.phase, ov.module, ov.kind, ov.propagated) == (1, 1, "data", "", "nan", False)
    per = tr.overflows(per_rank=True)
    assert per[["step", "rank", "phase", "tensor", "propagated"]].values.tolist() == [
        [1, 0, "backward", "weight.grad", True],
        [1, 1, "data", "input[0]", False],
    ]


# ------------------------------------------------------------------------------------------------ no process group
def test_without_process_group_rank_is_zero_and_save_is_one_file(tmp_path: Path) -> None:
    m = Net()
    with nantrace.trace(m, live_every=2) as tr:
        m(torch.randn(2, 4))
    assert (tr.rank, tr.world_size, tr.ranks) == (0, 1, [0])
    assert set(tr.records["rank"]) == {0} and set(tr.steps["rank"]) == {0}
    assert not tr.records["reduced"].any()
    assert tr.live_reports == []
    p = tr.save(tmp_path / "one.nantrace")
    assert p.is_file() and p == tmp_path / "one.nantrace"
    back = nantrace.load(p)
    assert (back.rank, back.world_size) == (0, 1)


def test_live_every_is_validated() -> None:
    with pytest.raises(ValueError, match=r"live_every must be None \(off\) or an int ≥ 1.*got 0"):
        nantrace.trace(Net(), live_every=0)


def test_part_target_conflicts(tmp_path: Path) -> None:
    from nantrace._procgroup import part_target

    f = tmp_path / "single.nantrace"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"is an existing file, but under torch\.distributed"):
        part_target(f, 0, 2)
    d = tmp_path / "run"
    assert part_target(d, 1, 2) == d / "rank-00001-of-00002.nantrace"
    (d / "rank-00000-of-00004.nantrace").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"world size 4 \(this run has 2 ranks"):
        part_target(d, 0, 2)


def test_folder_with_missing_rank_loads_with_a_warning(runs: Path, tmp_path: Path) -> None:
    d = tmp_path / "partial"
    d.mkdir()
    name = "rank-00001-of-00002.nantrace"
    (d / name).write_bytes((runs / "nan_data" / name).read_bytes())
    with pytest.warns(UserWarning, match=r"holds 1 of 2 rank parts; ranks \[0\] are missing"):
        tr = nantrace.load(d)
    assert tr.ranks == [1]
    ov = tr.first_overflow()
    assert ov is not None and (ov.rank, ov.phase) == (1, "data")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(nantrace.NantraceError, match="folder without nantrace rank parts"):
        nantrace.load(empty)


def test_merged_trace_saves_as_one_file_and_loads_back(runs: Path, tmp_path: Path) -> None:
    tr = nantrace.load(runs / "nan_data")
    p = tr.save(tmp_path / "merged.nantrace")
    back = nantrace.load(p)
    assert back.ranks == [0, 1] and back.world_size == 2
    assert back.first_overflow() == tr.first_overflow()
    assert len(back.records) == len(tr.records)


def test_fsdp1_and_checkpoint_wrapper_names_without_process_group() -> None:
    """Wrapper names without a process group: the ``_fsdp_wrapped_module`` attribute FSDP1 uses (on a stand-in,
    since FSDP1 needs a process group; the real one runs in ``test_fsdp1_on_gloo``) around a model holding the
    real checkpoint wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    class FakeFSDP(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self._fsdp_wrapped_module = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self._fsdp_wrapped_module(x)

    m = Net()
    m.fc1 = checkpoint_wrapper(m.fc1)  # type: ignore[assignment]
    wrapped = FakeFSDP(m)
    assert [n for n, _ in module_names(wrapped)] == ["", "fc1", "act", "fc2"]


# ------------------------------------------------------------------------------------------------ ordering rule
def _parts_of(tmp: Path, name: str, per_rank: list[list[torch.Tensor]]) -> nantrace.Trace:
    """A folder of rank parts from single-process float32 runs of Net (fc2 weights 1.0: output 16 x for a
    constant input x), each forward its own step; merged by nantrace.load."""
    folder = tmp / name
    folder.mkdir()
    for rank, xs in enumerate(per_rank):
        m = Net()
        with torch.no_grad():
            m.fc2.weight.fill_(1.0)
            m.fc2.bias.zero_()
        with nantrace.trace(m, drill=False) as tr:
            for x in xs:
                m(x)
        tr.save(folder / f"rank-{rank:05d}-of-{len(per_rank):05d}.nantrace")
    return nantrace.load(folder)


def _first(tr: nantrace.Trace) -> tuple[Any, ...]:
    ov = tr.first_overflow()
    assert ov is not None
    return (ov.rank, ov.step, ov.phase, ov.module, ov.kind)


def test_cross_rank_ordering_step_then_phase_then_seq_then_rank(tmp_path: Path) -> None:
    ok = torch.ones(2, 4)
    nan = torch.ones(2, 4)
    nan[0, 1] = float("nan")
    fc1_inf = torch.full((2, 4), 2e38)  # fc1: 4 * 0.5 * 2e38 = 4e38 > float32 max 3.4e38
    fc2_inf = torch.full((2, 4), 3e37)  # fc1 6e37 is finite; fc2: 8 * 6e37 = 4.8e38 is not
    # the same step: data (rank 1) comes before forward (rank 0)
    assert _first(_parts_of(tmp_path, "phase", [[ok, fc1_inf], [ok, nan]])) == (1, 1, "data", "", "nan")
    # the earlier step wins over the earlier phase
    assert _first(_parts_of(tmp_path, "step", [[ok, nan], [fc1_inf, ok]])) == (1, 0, "forward", "fc1", "inf")
    # the same step and phase: the earlier position in the step (fc1 before fc2), whatever the rank
    assert _first(_parts_of(tmp_path, "seq", [[fc2_inf], [fc1_inf]])) == (1, 0, "forward", "fc1", "inf")
    # the same event on both ranks: the lowest rank; the other is a producer too
    tr = _parts_of(tmp_path, "tie", [[ok, fc1_inf], [ok, fc1_inf]])
    assert _first(tr) == (0, 1, "forward", "fc1", "inf")
    per = tr.overflows(per_rank=True)
    assert per[["step", "rank", "module", "propagated"]].values.tolist() == [
        [1, 0, "fc1", False],
        [1, 1, "fc1", False],
    ]


# ------------------------------------------------------------------------------------------------ example
def test_example_runs_under_torchrun(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(ROOT / "examples" / "ddp_nan.py"),
        "--out",
        str(tmp_path / "trace"),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "nantrace: rank 1 produced NaN in the model inputs at step 3 (data)" in res.stderr
    assert "first overflow: rank 1, step 3, data" in res.stdout
    tr = nantrace.load(tmp_path / "trace")
    ov = tr.first_overflow()
    assert ov is not None and (ov.rank, ov.step, ov.phase) == (1, 3, "data")
