"""Fault injection: a streamed trace survives SIGKILL, write errors never reach the training loop, damaged files
are named, ``nantrace run`` saves under SIGTERM, and earlier traces are not overwritten silently."""

from __future__ import annotations

import os
import random
import re
import resource
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

import nantrace
from nantrace._store import segment_dir

CHILD = """
import sys, torch, nantrace
from torch import nn
path, n, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 1, bias=False))
with nantrace.trace(m, path=path, flush_every=every) as tr:
    for step in range(n):
        with torch.no_grad():
            m(torch.full((1, 2), float(step)))
        print(step, flush=True)
print("completed", len(tr.steps), sorted(set(tr.records["step"].tolist())) == list(range(n)), flush=True)
"""

ROWS_PER_STEP = 6  # data, 2 x (input, output), root output


def _child(tmp_path: Path) -> Path:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return script


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 1, bias=False))


def test_sigkill_at_random_points_loses_no_flushed_step(tmp_path: Path) -> None:
    script = _child(tmp_path)
    rng = random.Random(19)
    for trial in range(3):
        path = tmp_path / f"killed{trial}.nantrace"
        kill_after = rng.randrange(6, 40)  # the child printed this step: steps before it are closed
        proc = subprocess.Popen(
            [sys.executable, str(script), str(path), "100000", "5"], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            if int(line) == kill_after:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        assert not path.exists()
        with pytest.warns(UserWarning, match="was not closed"):
            back = nantrace.load(path)
        n = len(back.steps)
        flushed = kill_after // 5 * 5  # step kill_after-1 closed at the forward of kill_after
        assert n >= flushed and n % 5 == 0, (kill_after, n)
        assert back.steps["step"].tolist() == list(range(n))
        assert sorted(set(back.records["step"].tolist())) == list(range(n))
        assert len(back.records) == n * ROWS_PER_STEP
        assert back.header["incomplete"] is True


def test_writes_failing_under_a_file_size_limit_never_stop_training(tmp_path: Path) -> None:
    script = _child(tmp_path)
    path = tmp_path / "full.nantrace"

    def limit() -> None:  # a disk that fills up: writes past 60 kB fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))

    done = subprocess.run(
        [sys.executable, str(script), str(path), "40", "5"],
        capture_output=True,
        text=True,
        preexec_fn=limit,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "completed 40 True"  # every step, in memory where the disk refused
    assert done.stderr.count(f"writing the trace to {str(path)!r} failed") == 1  # warned once
    assert "could not be completed" in done.stderr  # reported at exit
    with pytest.warns(UserWarning, match="was not closed"):
        back = nantrace.load(path)  # the segments the disk took
    n = len(back.steps)
    assert n >= 5 and back.steps["step"].tolist() == list(range(n))
    assert len(back.records) == n * ROWS_PER_STEP


def test_a_failing_write_is_retried_and_never_raised(tmp_path: Path) -> None:
    path = tmp_path / "ro.nantrace"
    m = _model()
    blocker = segment_dir(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nantrace.trace(m, path=path, flush_every=2) as tr:
            blocker.write_text("not a folder")  # every segment write fails, as on a read-only mount
            for step in range(7):
                with torch.no_grad():
                    m(torch.full((1, 2), float(step)))
                if step == 4:
                    in_memory = sorted(set(tr._recording.store.records()["step"].tolist()))
                    blocker.unlink()  # the disk is back: the next flush writes everything kept
    failed = [str(w.message) for w in caught if "failed" in str(w.message)]
    assert len(failed) == 1 and repr(str(path)) in failed[0]
    assert in_memory == [0, 1, 2, 3]  # nothing dropped while the writes failed
    assert any("complete now after earlier write errors" in str(w.message) for w in caught)
    back = nantrace.load(path)
    assert back.steps["step"].tolist() == list(range(7))
    pd.testing.assert_frame_equal(back.records, tr.records)


def test_streamed_files_get_the_ordinary_mode(tmp_path: Path) -> None:
    path = tmp_path / "mode.nantrace"
    m = _model()
    umask = os.umask(0o022)
    try:
        with nantrace.trace(m, path=path, flush_every=1):
            for _step in range(2):
                with torch.no_grad():
                    m(torch.ones(1, 2))
        assert (path.stat().st_mode & 0o777) == 0o644
    finally:
        os.umask(umask)
    assert not segment_dir(path).exists()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nantrace.Trace]:
    m = _model()
    with nantrace.trace(m) as tr:
        for step in range(3):
            with torch.no_grad():
                m(torch.full((1, 2), float(step)))
    path = tmp_path_factory.mktemp("damage") / "good.nantrace"
    tr.save(path)
    return path, nantrace.load(path)


def test_truncated_files_raise_naming_the_file(saved: tuple[Path, nantrace.Trace], tmp_path: Path) -> None:
    path, _ = saved
    data = path.read_bytes()
    for cut in (0, 4, len(data) // 3, len(data) // 2, len(data) - 9, len(data) - 1):
        bad = tmp_path / f"cut{cut}.nantrace"
        bad.write_bytes(data[:cut])
        with pytest.raises(nantrace.NantraceError) as info:
            nantrace.load(bad)
        assert repr(str(bad)) in str(info.value)


def test_flipped_bytes_raise_or_load_the_original(saved: tuple[Path, nantrace.Trace], tmp_path: Path) -> None:
    path, good = saved
    data = path.read_bytes()
    rng = random.Random(19)
    raised = 0
    for i in range(60):
        pos = rng.randrange(len(data))
        flipped = bytearray(data)
        flipped[pos] ^= 1 << rng.randrange(8)
        bad = tmp_path / f"flip{i}.nantrace"
        bad.write_bytes(bytes(flipped))
        try:
            back = nantrace.load(bad)
        except nantrace.NantraceError as e:
            assert repr(str(bad)) in str(e), (pos, e)
            raised += 1
            continue
        pd.testing.assert_frame_equal(back.records, good.records)
        pd.testing.assert_frame_equal(back.steps, good.steps)
        pd.testing.assert_frame_equal(back.ops, good.ops)
    assert raised > 0


def test_every_flip_in_the_nantrace_metadata_raises(
    saved: tuple[Path, nantrace.Trace], tmp_path: Path
) -> None:
    # the JSON header with the steps/ops tables and their sha256 sits verbatim in the parquet footer: a flipped
    # bit anywhere in it (a value, a key, the digest, a brace) is refused, never loaded as something else
    path, _ = saved
    data = path.read_bytes()
    start = data.index(b'{"header"')
    end = data.index(b'"}', data.index(b'"sha256"', start)) + 2
    spread = [(pos, 1 << (i % 8)) for i, pos in enumerate(range(start, end, max(1, (end - start) // 80)))]
    keys = [
        (data.index(k, start) + 1, 1) for k in (b'"header"', b'"steps"', b'"ops"', b'"sha256"')
    ]  # renamed
    for i, (pos, bit) in enumerate(spread + keys):
        flipped = bytearray(data)
        flipped[pos] ^= bit
        bad = tmp_path / f"meta{i}.nantrace"
        bad.write_bytes(bytes(flipped))
        with pytest.raises(nantrace.NantraceError, match=r"damaged|not a nantrace trace"):
            nantrace.load(bad)


def test_report_of_a_damaged_file_prints_one_line_and_exits_2(
    saved: tuple[Path, nantrace.Trace], tmp_path: Path
) -> None:
    path, _ = saved
    bad = tmp_path / "torn.nantrace"
    bad.write_bytes(path.read_bytes()[:-100])
    done = subprocess.run(
        [sys.executable, "-m", "nantrace", "report", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and str(bad) in done.stderr
    assert "Traceback" not in done.stderr


def test_save_refuses_to_replace_a_file_that_is_not_a_trace(
    saved: tuple[Path, nantrace.Trace], tmp_path: Path
) -> None:
    _, good = saved
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with pytest.raises(nantrace.NantraceError, match="not a nantrace trace") as info:
        good.save(notes)
    assert repr(str(notes)) in str(info.value)
    assert notes.read_text() == "my notes\n"
    again = tmp_path / "again.nantrace"
    good.save(again)
    good.save(again)  # replacing a trace is allowed
    assert len(nantrace.load(again).steps) == 3


@pytest.mark.parametrize("entry", ["trace", "watch"])
def test_streaming_refuses_a_path_that_holds_a_file_not_a_trace(entry: str, tmp_path: Path) -> None:
    """``trace(path=...)`` (and ``watch``) replaces ``path`` with the trace when it closes: a file of the user's
    there is refused before anything is attached, and left as it was."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scale = scaler.scale
    with pytest.raises(
        nantrace.NantraceError, match=re.escape("trace(path=...) does not replace it")
    ) as info:
        getattr(nantrace, entry)(model, scaler=scaler, optimizer=opt, path=notes)
    assert repr(str(notes)) in str(info.value)
    assert notes.read_text() == "my notes\n"
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert scaler.scale == scale and not opt._optimizer_step_post_hooks
    done = tmp_path / "done.nantrace"
    with nantrace.trace(model, optimizer=opt, path=done):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    with nantrace.trace(model, optimizer=opt, path=done):  # replacing an earlier trace is allowed
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    assert len(nantrace.load(done).steps) == 1


TRAIN = """
import torch
from torch import nn
m = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 1, bias=False))
opt = torch.optim.SGD(m.parameters(), lr=0.0)
for step in range(100000):
    loss = m(torch.ones(1, 2)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(step, flush=True)
"""


def test_nantrace_run_under_sigterm_saves_and_reports(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nantrace", "run", "--out", str(out), str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if int(line) == 3:
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "SIGTERM" in err and "nantrace report" in err  # the report was printed
    back = nantrace.load(out / "trace.nantrace")
    assert len(back.steps) >= 4


def test_run_and_demo_refuse_to_overwrite_an_earlier_trace(
    saved: tuple[Path, nantrace.Trace], tmp_path: Path
) -> None:
    _path, good = saved
    out = tmp_path / "out"
    out.mkdir()
    good.save(out / "trace.nantrace")
    script = tmp_path / "noop.py"
    script.write_text("print('ran')\n")
    for cmd in (["run", "--out", str(out), str(script)], ["demo", "--out", str(out), "--steps", "2"]):
        done = subprocess.run(
            [sys.executable, "-m", "nantrace", *cmd], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2, done.stderr
        assert "--overwrite" in done.stderr and "trace.nantrace" in done.stderr
        assert "ran" not in done.stdout
        assert len(nantrace.load(out / "trace.nantrace").steps) == 3  # the earlier trace is intact
    done = subprocess.run(
        [sys.executable, "-m", "nantrace", "run", "--overwrite", "--out", str(out), str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout == "ran\n"


def test_a_rank_part_killed_while_streaming_loads_from_its_segments(tmp_path: Path) -> None:
    """A folder of rank parts in which one rank never closed its streamed part (killed): the merged load reads
    what that rank flushed, with a warning, instead of missing the rank."""
    import warnings as _warnings

    import torch
    from torch import nn

    import nantrace

    folder = tmp_path / "run.nantrace"
    folder.mkdir()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    with nantrace.trace(model) as done:
        for _ in range(2):
            model(torch.ones(3, 4))
    done.save(folder / "rank-00000-of-00002.nantrace")
    killed = nantrace.trace(model, path=folder / "rank-00001-of-00002.nantrace", flush_every=1)
    killed.__enter__()
    for _ in range(3):
        model(torch.ones(3, 4))
    model(torch.ones(3, 4))  # opens step 3; steps 0-2 were flushed as segments
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        merged = nantrace.load(folder)
    assert merged.ranks == [0, 1]
    assert sorted(merged.steps.groupby("rank")["step"].apply(list).to_dict().items()) == [
        (0, [0, 1]),
        (1, [0, 1, 2]),
    ]
    assert any("was not closed" in str(w.message) for w in caught)
    killed.__exit__(None, None, None)
