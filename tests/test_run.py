"""``nantrace run``: unmodified scripts traced through the global hooks, in a subprocess as a user runs them."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.nn.modules import module as torch_module
from torch.optim import optimizer as torch_optimizer

import nantrace
from nantrace._run import print_run_report, run_script

# A half-precision two-layer model; at step 2 the batch is 60000 everywhere and fc1 (weights 1) sums four of
# them: 240000 overflows float16 (max 65504) in fc1's forward. It is called with a keyword argument.
PLANTED = """
import sys
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc2(self.fc1(x))

torch.manual_seed(0)
model = Net().half()
with torch.no_grad():
    model.fc1.weight.fill_(1.0)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn = nn.MSELoss()  # parameter-free: not a root
print("argv", sys.argv[1:], __name__)
for step in range(4):
    x = torch.full((2, 4), 60000.0 if step == 2 else 0.01).half()
    loss = loss_fn(model(x=x).float(), torch.zeros(2, 1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    print("step", step, repr(loss.item()))
{tail}
"""


def _write(tmp_path: Path, body: str, name: str = "train.py") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


def _nantrace_run(
    tmp_path: Path, script: Path, *args: str, out: str = "out"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nantrace", "run", "--out", str(tmp_path / out), str(script), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )


def _python(tmp_path: Path, script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )


def _steps_printed(stdout: str) -> list[float]:
    lines = stdout.splitlines()
    assert lines[0] == "argv ['--lr', '3', '--out', 'x'] __main__"
    assert [line.split()[:2] for line in lines[1:]] == [["step", str(i)] for i in range(4)]
    return [float(line.split()[2]) for line in lines[1:]]


def test_planted_overflow_located_and_output_preserved(tmp_path: Path) -> None:
    script = _write(tmp_path, PLANTED.format(tail=""))
    # options after the script are the script's, also ones nantrace run has itself (--out)
    r = _nantrace_run(tmp_path, script, "--lr", "3", "--out", "x")
    assert r.returncode == 0, r.stderr
    plain = _python(tmp_path, script, "--lr", "3", "--out", "x")
    assert plain.returncode == 0 and plain.stderr == ""
    assert r.stdout == plain.stdout  # the script's stdout, untouched; nantrace's report goes to stderr
    printed = _steps_printed(r.stdout)
    assert "first overflow: step 2, forward, module `fc1` (Linear), inf" in r.stderr
    assert "nantrace run: traced 1 model(s): `model` (Net)" in r.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["trace.nantrace"]
    tr = nantrace.load(tmp_path / "out" / "trace.nantrace")
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.step, ov.phase, ov.module, ov.tensor, ov.kind) == (2, "forward", "fc1", "output", "inf")
    assert tr.header["model_class"] == "Net"
    assert tr.options["name"] == "model"
    assert tr.options["optimizer"] == "SGD"  # bound at its first step: steps are optimizer steps
    assert tr.steps["step"].tolist() == [0, 1, 2, 3]
    assert tr.steps["micro_steps"].tolist() == [1, 1, 1, 1]
    # no GradScaler: the loss is the tensor backward() was called on (fc2 mixes fc1's ±inf into NaN at step 2)
    assert tr.steps["loss"].tolist()[:2] == pytest.approx(printed[:2], rel=1e-6)
    assert math.isnan(printed[2]) and math.isnan(tr.steps["loss"].tolist()[2])
    # the root's first call (a keyword argument) was recorded by the pre-hook run for it
    data = tr.records[(tr.records["phase"] == "data") & (tr.records["step"] == 0)]
    assert data["tensor"].astype(str).tolist() == ["input.x"]


def test_exception_exit_code_traceback_and_trace(tmp_path: Path) -> None:
    script = _write(tmp_path, PLANTED.format(tail="raise RuntimeError('diverged on purpose')"))
    r = _nantrace_run(tmp_path, script, "--lr", "3", "--out", "x")
    assert r.returncode == 1
    _steps_printed(r.stdout)
    tb = r.stderr.split("\n\nnantrace run:")[0]
    assert tb.startswith("Traceback (most recent call last):\n")
    assert f'File "{script}", line ' in tb
    assert tb.endswith("RuntimeError: diverged on purpose")
    assert "runpy" not in tb and "_run.py" not in tb
    ov = nantrace.load(tmp_path / "out" / "trace.nantrace").first_overflow()
    assert ov is not None and (ov.step, ov.module) == (2, "fc1")


def test_sys_exit_code_preserved(tmp_path: Path) -> None:
    script = _write(tmp_path, PLANTED.format(tail="sys.exit(3)"))
    r = _nantrace_run(tmp_path, script, "--lr", "3", "--out", "x")
    assert r.returncode == 3
    _steps_printed(r.stdout)
    tr = nantrace.load(tmp_path / "out" / "trace.nantrace")
    assert len(tr.steps) == 4


def test_ctrl_c_exit_code_130(tmp_path: Path) -> None:
    """A real SIGINT (what Ctrl-C sends) after two steps: exit 130, the two steps saved."""
    body = PLANTED.replace(
        '    print("step", step, repr(loss.item()))\n',
        '    print("step", step)\n    if step == 1:\n        import os, signal\n'
        "        os.kill(os.getpid(), signal.SIGINT)\n",
    )
    script = _write(tmp_path, body.format(tail=""))
    r = _nantrace_run(tmp_path, script)
    assert r.returncode == 130
    assert r.stdout == "argv [] __main__\nstep 0\nstep 1\n"
    assert "KeyboardInterrupt" in r.stderr
    tr = nantrace.load(tmp_path / "out" / "trace.nantrace")
    assert tr.steps["step"].tolist() == [0, 1]
    assert tr.first_overflow() is None


# A GAN with one GradScaler for both models (the recipe of PyTorch's AMP docs), inside a function. At step 1 the
# real batch holds 1e5: finite in float32, +inf once autocast casts it to float16 inside D's Linear.
GAN = """
import torch
from torch import nn

class Gen(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 3)

    def forward(self, z):
        return self.fc(z)

class Disc(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 1)

    def forward(self, x):
        return self.fc(x)

def main():
    torch.manual_seed(0)
    G, D = Gen(), Disc()
    opt_g = torch.optim.SGD(G.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(D.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    bce = nn.BCEWithLogitsLoss()
    for step in range(3):
        z = torch.randn(2, 2)
        real = torch.randn(2, 3)
        if step == 1:
            real[:, 0] = 1e5
        with torch.autocast("cpu", dtype=torch.float16):
            fake = G(z)
            d_loss = bce(D(real), torch.ones(2, 1)) + bce(D(fake.detach()), torch.zeros(2, 1))
        opt_d.zero_grad()
        scaler.scale(d_loss).backward()
        scaler.step(opt_d)
        with torch.autocast("cpu", dtype=torch.float16):
            g_loss = bce(D(fake), torch.ones(2, 1))
        opt_g.zero_grad()
        scaler.scale(g_loss).backward()
        scaler.step(opt_g)
        scaler.update()
        print(repr(g_loss.item()), repr(d_loss.item()))

main()
"""


def test_two_models_get_their_own_names_and_files(tmp_path: Path) -> None:
    script = _write(tmp_path, GAN)
    r = _nantrace_run(tmp_path, script)
    assert r.returncode == 0, r.stderr
    losses = [tuple(float(v) for v in line.split()) for line in r.stdout.splitlines()]
    assert len(losses) == 3
    assert "nantrace run: traced 2 model(s): `G` (Gen), `D` (Disc)" in r.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["trace.D.nantrace", "trace.nantrace"]
    g, d = nantrace.load(out / "trace.nantrace"), nantrace.load(out / "trace.D.nantrace")
    assert (g.header["model_class"], g.options["name"]) == ("Gen", "G")
    assert (d.header["model_class"], d.options["name"]) == ("Disc", "D")
    assert g.first_overflow() is None
    ov = d.first_overflow()
    assert ov is not None
    assert (ov.step, ov.micro_step, ov.phase, ov.module, ov.kind) == (1, 0, "forward", "fc", "inf")
    for tr in (g, d):
        assert tr.steps["step"].tolist() == [0, 1, 2]
        assert tr.steps["scale"].tolist() == [8.0, 8.0, 4.0]  # the shared scaler skipped step 1
        assert tr.steps["skipped"].tolist() == [False, True, False]
    # one scaler, two models: G's loss is g_loss only (d_loss's graph does not reach G through fake.detach());
    # D's graph is reached by both losses
    assert g.steps["loss"].tolist() == pytest.approx([gl for gl, _ in losses], rel=1e-6)
    want_d = [(gl + dl) / 2 for gl, dl in losses]
    assert [v for i, v in enumerate(d.steps["loss"].tolist()) if i != 1] == pytest.approx(
        [v for i, v in enumerate(want_d) if i != 1], rel=1e-6
    )


def test_tensorboard_option(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    script = _write(tmp_path, GAN)
    r = subprocess.run(
        [sys.executable, "-m", "nantrace", "run", "--out", "out", "--tensorboard", "tb", str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    tags = ea.Tags()["scalars"]
    assert [(e.step, e.value) for e in ea.Scalars("nantrace/D/skipped")] == [(0, 0.0), (1, 1.0), (2, 0.0)]
    assert [(e.step, e.value) for e in ea.Scalars("nantrace/D/nonfinite/absmax/fc")] == [
        (0, 0.0),
        (1, 1.0),
        (2, 0.0),
    ]
    assert "nantrace/G/loss" in tags


def test_usage_errors(tmp_path: Path) -> None:
    r = _nantrace_run(tmp_path, tmp_path / "missing.py")
    assert r.returncode == 2
    assert "missing.py' is not a file" in r.stderr
    script = _write(tmp_path, "print('hi')\n")
    r = subprocess.run(
        [sys.executable, "-m", "nantrace", "run", "--phases", "forward,bogus", str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 2
    assert "--phases 'forward,bogus'" in r.stderr
    assert r.stdout == ""  # the script did not run
    r = subprocess.run(
        [sys.executable, "-m", "nantrace", "run", "--every", "0", str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "nantrace: error: --every 0: every must be an int ≥ 1 (record full statistics every N-th step); got 0. "
        "Use --every 1 to record every step."
    )


def test_api_restores_hooks_scaler_argv_and_path(tmp_path: Path) -> None:
    """In process: after a script that raises, GradScaler.__init__, the global hooks, the scaler instance,
    sys.argv and sys.path are exactly as before, and the traces are closed."""
    script = _write(
        tmp_path,
        """
        import sys
        import torch
        from torch import nn
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.ones(1, 2)).float().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        sys.path.append("/nowhere")
        raise ValueError("stop")
        """,
    )
    init = torch.amp.GradScaler.__dict__["__init__"]
    opt_init = torch.optim.Optimizer.__dict__["__init__"]
    backward = torch.Tensor.__dict__["backward"]
    hooks = (
        dict(torch_module._global_forward_pre_hooks),
        dict(torch_module._global_forward_hooks),
        dict(torch_optimizer._global_optimizer_pre_hooks),
        dict(torch_optimizer._global_optimizer_post_hooks),
    )
    argv, path = list(sys.argv), list(sys.path)
    result = run_script(script, ["a"], out=tmp_path)
    assert result.exit_code == 1
    assert torch.amp.GradScaler.__dict__["__init__"] is init
    assert (
        dict(torch_module._global_forward_pre_hooks),
        dict(torch_module._global_forward_hooks),
        dict(torch_optimizer._global_optimizer_pre_hooks),
        dict(torch_optimizer._global_optimizer_post_hooks),
    ) == hooks
    assert sys.argv == argv and sys.path == path
    assert list(result.traces) == ["model"]
    tr = result.traces["model"]
    scaler = tr._recording.scaler
    assert scaler is not None
    assert "scale" not in vars(scaler) and "update" not in vars(scaler)  # the trace's patches are gone
    assert tr._recording.handles == [] and tr._recording.closed
    assert tr.steps["scale"].tolist() == [4.0, 4.0]
    assert torch.Tensor.__dict__["backward"] is backward
    assert torch.optim.Optimizer.__dict__["__init__"] is opt_init
    assert result.paths == {"model": tmp_path / "trace.nantrace"}


def test_api_no_model_called_writes_nothing(tmp_path: Path) -> None:
    script = _write(tmp_path, "import torch\nprint(torch.ones(2).sum().item())\n")
    result = run_script(script, out=tmp_path)
    assert (result.exit_code, result.traces, result.paths) == (0, {}, {})
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]
    text = io.StringIO()
    print_run_report(result, text)
    assert text.getvalue() == (
        "\nnantrace run: no model was traced: the script called no nn.Module with parameters.\n"
    )


def test_api_modules_filter_matching_nothing_leaves_root_untraced(tmp_path: Path) -> None:
    script = _write(
        tmp_path,
        """
        import torch
        from torch import nn
        net = nn.Sequential(nn.Linear(2, 2))
        net(torch.ones(1, 2))
        """,
    )
    result = run_script(script, out=tmp_path, modules="encoder.*")
    assert result.exit_code == 0 and result.traces == {}
    assert len(result.notes) == 1
    assert result.notes[0].startswith(
        "`net` (Sequential) was not traced: modules='encoder.*' matched no module"
    )


def test_api_gradient_accumulation_without_scaler(tmp_path: Path) -> None:
    """Two micro-steps per optimizer step, no GradScaler: the optimizer is known from its creation, so both
    forwards of the first step are one step; each step's loss is the mean of the two backward() losses."""
    script = _write(
        tmp_path,
        """
        import torch
        from torch import nn
        net = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            net.weight.fill_(1.0)
        opt = torch.optim.SGD(net.parameters(), lr=0.0)
        for step in range(2):
            for micro in range(2):
                loss = net(torch.full((1, 1), float(1 + micro + 2 * step))).sum()
                loss.backward()
            opt.step()
            opt.zero_grad()
        """,
    )
    result = run_script(script, out=tmp_path)
    assert result.exit_code == 0, result.notes
    st = result.traces["net"].steps
    assert st["step"].tolist() == [0, 1]
    assert st["micro_steps"].tolist() == [2, 2]
    assert st["loss"].tolist() == [1.5, 3.5]  # (1 + 2) / 2, (3 + 4) / 2


def test_api_optimizer_created_after_first_call(tmp_path: Path) -> None:
    """A warm-up call before the optimizer exists: the optimizer is bound when it is created."""
    script = _write(
        tmp_path,
        """
        import torch
        from torch import nn
        net = nn.Linear(1, 1)
        with torch.no_grad():
            net(torch.ones(1, 1))
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
        for _ in range(3):
            net(torch.ones(1, 1)).sum().backward()
            opt.step()
            opt.zero_grad()
        """,
    )
    tr = run_script(script, out=tmp_path).traces["net"]
    assert tr.options["optimizer"] == "Adam"
    assert tr.steps["micro_steps"].tolist() == [2, 1, 1]  # the warm-up call is step 0's first micro-step
    after = tr.records[tr.records["phase"] == "optimizer"]
    assert sorted(set(after["step"].tolist())) == [0, 1, 2]


def test_api_naming_keeps_no_local_alive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Naming a root reads the calling frames' locals; the batch of that moment must not stay referenced."""
    script = _write(
        tmp_path,
        """
        import gc, weakref
        import torch
        from torch import nn

        def train():
            model = nn.Linear(2, 1)
            x = torch.ones(1, 2)
            alive = weakref.ref(x)
            model(x)
            x = None
            gc.collect()
            print("batch alive:", alive() is not None)

        train()
        """,
    )
    result = run_script(script, out=tmp_path)
    assert result.exit_code == 0 and list(result.traces) == ["model"]
    assert capsys.readouterr().out == "batch alive: False\n"


DDP = """
import sys

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
for step in range(3):
    x = torch.ones(2, 4)
    if rank == 1 and step == 1:
        x[0, 0] = float("nan")  # rank 1's batch is corrupt at step 1
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    sys.stdout.write(f"rank {rank} step {step}\\n")  # one write: the two ranks share the pipe
dist.destroy_process_group()
"""


def test_under_torchrun_each_rank_saves_its_part(tmp_path: Path) -> None:
    """``torchrun -m nantrace run``: the DDP wrapper is the root (once, although it is called every step), the
    late-bound optimizer and scaler also record the all-reduced gradients, and the parts merge on load."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = _write(tmp_path, DDP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    cmd += ["-m", "nantrace", "run", "--out", str(tmp_path / "out"), str(script)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(r.stdout.splitlines()) == sorted(f"rank {k} step {s}" for k in (0, 1) for s in range(3))
    assert r.stderr.count("nantrace run: traced 1 model(s): `model` (DistributedDataParallel)") == 2
    assert "was not traced" not in r.stderr
    part_names = sorted(p.name for p in (tmp_path / "out" / "trace.nantrace").iterdir())
    assert part_names == ["rank-00000-of-00002.nantrace", "rank-00001-of-00002.nantrace"]
    # every rank's closing hint names the folder all ranks saved to, which load merges, not its own part
    hint = f"read it back with: nantrace report {tmp_path / 'out' / 'trace.nantrace'}\n"
    assert (
        r.stderr.count(hint) == 2
        and "nantrace report " + str(tmp_path / "out" / "trace.nantrace" / "rank") not in r.stderr
    )
    tr = nantrace.load(tmp_path / "out" / "trace.nantrace")
    ov = tr.first_overflow()
    assert ov is not None
    assert (ov.rank, ov.step, ov.phase, ov.module, ov.kind) == (1, 1, "data", "", "nan")
    reduced = tr.records[tr.records["reduced"].astype(bool)]
    assert sorted(set(reduced["rank"].tolist())) == [0, 1]
    assert sorted(set(reduced["tensor"].astype(str).tolist())) == ["bias.grad", "weight.grad"]


def test_script_globals_match_plain_python(tmp_path: Path) -> None:
    """argv (argv[0] as typed), __name__, __file__, sys.path[0], __spec__ and pickling by __main__ are what
    plain ``python`` gives."""
    _write(
        tmp_path,
        """
        import pickle, sys
        class Box:
            pass
        print(sys.argv, __name__, __file__, sys.path[0], __spec__, sys.modules["__main__"].Box is Box)
        print(type(pickle.loads(pickle.dumps(Box()))).__name__)
        """,
        name="acc.py",
    )
    plain = subprocess.run(
        [sys.executable, "acc.py", "a", "b"], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    traced = subprocess.run(
        [sys.executable, "-m", "nantrace", "run", "--out", "o", "acc.py", "a", "b"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert plain.returncode == 0 and traced.returncode == 0, traced.stderr
    expected = f"['acc.py', 'a', 'b'] __main__ {tmp_path / 'acc.py'} {tmp_path} None True\nBox\n"
    assert plain.stdout == expected
    assert traced.stdout == expected


def test_script_that_traces_itself_is_named_in_the_report(tmp_path: Path) -> None:
    script = _write(
        tmp_path,
        """
        import torch
        from torch import nn
        import nantrace
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with nantrace.trace(model, optimizer=opt) as tr:
            for _ in range(2):
                model(torch.ones(1, 2)).sum().backward()
                opt.step()
        model(torch.ones(1, 2))  # after its own trace ended: still not traced by nantrace run
        print(len(tr.steps))
        """,
    )
    result = run_script(script, out=tmp_path)
    assert (result.exit_code, result.traces, result.paths) == (0, {}, {})
    text = io.StringIO()
    print_run_report(result, text)
    assert text.getvalue() == (
        "\nnantrace run: no model was traced.\n"
        "nantrace run: `model` (Linear) was not traced: the script traces its own model with nantrace.trace(), "
        "which `nantrace run` does not support. Run the script with plain `python` and save its trace there "
        "with Trace.save, or remove its nantrace.trace() call.\n"
    )


def test_no_script_names_only_script_as_required_and_report_of_a_run_folder_suggests_its_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nantrace.cli import main

    with pytest.raises(SystemExit) as e:
        main(["run"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "nantrace run: error: the following arguments are required: script"
    )
    script = _write(tmp_path, PLANTED.format(tail=""))
    assert run_script(script, ["--lr", "3", "--out", "x"], out=tmp_path).paths == {
        "model": tmp_path / "trace.nantrace"
    }
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) != 0
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(f"; did you mean {str(tmp_path / 'trace.nantrace')!r} (a `nantrace run` output folder)?")
    )
