"""What a watch replay does with state the forward reads, several backward passes over one forward, the
gradient norm the backward left, a replay that raises, and a loss given to ``tr.step`` from a forward hook."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch import nn

import nantrace

FIELDS = ("step", "micro_step", "phase", "module", "module_type", "call", "tensor", "kind")


def _fields(ov: nantrace.Overflow | None) -> tuple[Any, ...] | None:
    return None if ov is None else tuple(getattr(ov, f) for f in FIELDS)


def _watch(model: nn.Module, **kw: Any) -> nantrace.Trace:
    return nantrace.watch(model, every=None, **kw)


class _Gain(nn.Module):
    """Multiplies by a buffer, then multiplies the buffer by 16 (a running normaliser, an EMA codebook): a
    replay after the step reads the buffer the step left."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("g", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * self.g.clone()
        with torch.no_grad():
            self.g.mul_(16.0)
        return out


def _gain_run(make: Any) -> nantrace.Trace:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), _Gain(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    with make(model, scaler=scaler, optimizer=opt) as tr:
        for step in range(4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.randn(3, 4))
            loss = out.float().pow(2).mean()
            if step == 3:
                loss = loss - torch.log(torch.tensor(0.0))  # the fault: a loss of +inf
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return tr


def test_a_replay_whose_forward_reads_a_buffer_the_step_changed_is_not_reproduced_not_invented() -> None:
    traced, watched = _gain_run(nantrace.trace), _gain_run(_watch)
    assert _fields(traced.first_overflow()) == (3, 0, "loss", "", "loss", 0, "loss", "inf")
    # the replayed forward read g = 16**4 and overflowed float16 in `1`: not what the real step computed
    assert watched.steps["recorded"].tolist() == ["watch", "watch", "watch", "not_reproduced"]
    ov = watched.first_overflow()
    assert _fields(ov) == _fields(traced.first_overflow())
    assert watched.options["watch"]["sentinel"]["3"]["outputs_differ"] == [0]
    assert str(ov).startswith(
        "nantrace.watch saw inf at step 3 (micro-step 0, loss: loss of the model), but the replayed forward of "
        "micro-step(s) 0 computed other outputs than the real one (their smallest or largest value differ)"
    )


def _two_passes(make: Any) -> nantrace.Trace:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with make(model, optimizer=opt) as tr:
        for step in range(3):
            if step == 1:
                with torch.no_grad():
                    model[2].weight.fill_(10.0)
            opt.zero_grad()
            out = model(torch.ones(2, 4, dtype=torch.float16))
            (out.float().sum() * (1e4 if step == 1 else 1.0)).backward(
                retain_graph=True
            )  # overflows at step 1
            (out.float().sum() * 1e-3).backward()  # a second pass over the same forward: finite
            tr.step(loss=out.float().sum())
            opt.step()
    return tr


def test_two_backward_passes_over_one_forward_are_replayed_in_their_order() -> None:
    traced, watched = _two_passes(nantrace.trace), _two_passes(_watch)
    assert _fields(traced.first_overflow()) == (1, 0, "backward", "2", "Linear", 0, "grad_input[0]", "inf")
    assert _fields(watched.first_overflow()) == _fields(traced.first_overflow())
    assert watched.steps["recorded"].tolist() == ["watch", "replay", "replay"]


def _penalty(make: Any) -> nantrace.Trace:
    """A gradient penalty (WGAN-GP, R1): ``torch.autograd.grad`` of the outputs with ``create_graph=True``,
    then a backward of a loss holding that gradient; at step 1 the first pass's gradient overflows float16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with make(model, optimizer=opt) as tr:
        for step in range(3):
            opt.zero_grad()
            x = torch.ones(2, 4, dtype=torch.float16, requires_grad=True)
            out = model(x)
            (g,) = torch.autograd.grad(out.float().sum() * (1e5 if step == 1 else 1.0), x, create_graph=True)
            loss = out.float().pow(2).mean() + (g.float().norm(dim=1) - 1).pow(2).mean()
            loss.backward()
            tr.step(loss=loss)
            opt.step()
    return tr


def test_a_gradient_penalty_pass_is_replayed_before_the_loss_backward() -> None:
    traced, watched = _penalty(nantrace.trace), _penalty(_watch)
    assert _fields(traced.first_overflow()) == (1, 0, "loss", "", "Sequential", 0, "grad_output[0]", "inf")
    assert _fields(watched.first_overflow()) == _fields(traced.first_overflow())
    assert watched.steps["recorded"].tolist() == ["watch", "replay", "replay"]


def _clipped(make: Any) -> list[float]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with make(model, optimizer=opt) as tr:
        for _ in range(3):
            opt.zero_grad()
            loss = model(torch.randn(8, 4) * 10).pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            tr.step(loss=loss)
            opt.step()
    return tr.steps["grad_norm"].tolist()


def test_a_watched_steps_gradient_norm_is_taken_before_the_loop_clips() -> None:
    traced, watched = _clipped(nantrace.trace), _clipped(_watch)
    assert [round(v, 4) for v in traced] == [75.4516, 66.8854, 75.4579]
    assert [round(v, 4) for v in watched] == [75.4516, 66.8854, 75.4579]  # not 1.0, the clipped norm


def _stale(make: Any) -> nantrace.Trace:
    """No ``zero_grad()``: step 1's float16 gradients overflow and stay in ``.grad`` for the later steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).half()
    with make(model) as tr:
        for step in range(4):
            loss = model(torch.ones(2, 4, dtype=torch.float16) * (1e5 if step == 1 else 1.0)).float().sum()
            loss.backward()
            tr.step(loss=loss)  # no optimizer: the weights stay finite, the gradients pile up
    return tr


def test_a_replayed_steps_gradient_norm_and_stale_count_are_the_real_steps() -> None:
    traced, watched = _stale(nantrace.trace), _stale(_watch)
    for tr in (traced, watched):
        steps = tr.steps
        assert steps["grad_norm"].isna().tolist() == [False, True, True, True]  # .grad held inf/NaN
        assert steps["stale_grads"].tolist() == [0.0, 0.0, 2.0, 2.0]
    assert watched.steps["recorded"].tolist() == ["watch", "replay", "replay", "replay"]
    r = watched.records
    replayed = r[(r["step"] == 2) & r["tensor"].astype(str).str.endswith(".grad")]
    assert (
        int((replayed["n_nan"] + replayed["n_posinf"] + replayed["n_neginf"]).sum()) == 0
    )  # its own: finite


def _raising_hook_run() -> tuple[nantrace.Trace, list[str]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).half()
    with torch.no_grad():
        model[1].weight.fill_(1e4)
    calls = [0]

    def hook(m: nn.Module, args: Any, out: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:  # the replay of step 1
            raise RuntimeError("boom")

    model[0].register_forward_hook(hook)
    with warnings.catch_warnings(record=True) as caught, _watch(model) as tr:
        warnings.simplefilter("always")
        for step in range(3):
            tr.step(
                model(torch.full((2, 4), 10.0 if step == 1 else 0.001, dtype=torch.float16)).float().sum()
            )
    return tr, [str(w.message) for w in caught if "could not replay" in str(w.message)]


def test_a_replay_that_raises_says_so_where_the_sentinel_saw_the_value() -> None:
    tr, warned = _raising_hook_run()
    assert warned == [
        "nantrace.watch could not replay step 1 (RuntimeError('boom')); first_overflow() reports what the replay "
        "recorded before it failed, or where the sentinel saw the value if it recorded nothing"
    ]
    assert tr.steps["recorded"].tolist() == ["watch", "not_reproduced", "watch"]
    ov = tr.first_overflow()
    assert _fields(ov) == (1, 0, "forward", "", "Sequential", 0, "output", "inf")
    assert str(ov).startswith(
        "nantrace.watch saw inf at step 1 (micro-step 0, forward: output of the model), but replaying the step "
        "raised RuntimeError: boom (forward or hook code that ran again)"
    )


def test_a_loss_given_to_tr_step_from_a_forward_hook_is_recorded_once_on_a_replayed_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    with _watch(model) as tr:
        model.register_forward_hook(lambda m, a, out: tr.step(loss=out.sum()))  # as the HF callback does
        for step in range(3):
            model(torch.full((2, 4), float("nan") if step == 1 else 1.0))
    assert tr.steps["recorded"].tolist() == ["watch", "replay", "watch"]
    loss_rows = tr.records[(tr.records["step"] == 1) & (tr.records["phase"] == "loss")]
    assert loss_rows["tensor"].tolist() == ["loss"]


def test_nantrace_run_watch_without_n_before_the_script_and_with_every(tmp_path: Any, capsys: Any) -> None:
    from nantrace import cli

    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch\n"
        "m = torch.nn.Linear(2, 1)\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    opt.zero_grad(); m(torch.ones(1, 2)).sum().backward(); opt.step()\n"
        "print('args', sys.argv[1:])\n"
    )
    # --watch right before the script: N is not the script's name; the script's own --watch stays its own
    assert cli.main(["run", "--watch", "--out", str(tmp_path / "a"), str(script), "--watch", "x"]) == 0
    assert capsys.readouterr().out == "args ['--watch', 'x']\n"
    assert cli.main(["run", "--out", str(tmp_path / "b"), "--watch", str(script)]) == 0
    assert nantrace.load(tmp_path / "b" / "trace.nantrace").steps["recorded"].tolist() == [
        "full",
        "watch",
        "watch",
    ]
    capsys.readouterr()
    assert cli.main(["run", "--watch", "2", "--every", "3", "--out", str(tmp_path / "c"), str(script)]) == 2
    assert capsys.readouterr().err.startswith(
        "nantrace: error: --every 3 with --watch: under --watch the full steps come every N of --watch N"
    )


def test_a_used_or_nested_watch_is_refused_in_its_own_words() -> None:
    import pytest

    model = nn.Linear(2, 1)
    tr = nantrace.watch(model)
    with tr:
        with pytest.raises(nantrace.NantraceError) as nested, nantrace.trace(model):
            pass
        model(torch.ones(1, 2))
    assert str(nested.value) == (
        "Linear is already being traced by another active nantrace.trace() or nantrace.watch(); nested traces "
        "of the same model are not supported: exit the first one"
    )
    with pytest.raises(nantrace.NantraceError) as again, tr:
        pass
    assert str(again.value) == "this Trace has already been used; create a new one with nantrace.watch(model)"


class _PrivateCounter(nn.Module):
    """Counts its calls in a private attribute and doubles its output on even calls."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self._n = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._n += 1
        y = torch.relu(self.fc(x))  # a ReLU's zeros: the drill-down replays the call under trace
        return y * 2 if self._n % 2 == 0 else y


def _counted(mode: str) -> tuple[list[float], int, list[str] | None]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), _PrivateCounter(), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # backs off at once: a replayed step under watch
    ctx: Any = {
        "plain": contextlib.nullcontext(),
        "trace": nantrace.trace(m, optimizer=opt, scaler=scaler),
        "watch": nantrace.watch(m, optimizer=opt, scaler=scaler, every=None),
    }[mode]
    losses = []
    with ctx as tr:
        for _ in range(4):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(torch.randn(4, 8)).float().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss))
    return losses, m[1]._n, None if tr is None else tr.steps["recorded"].tolist()


def test_replays_set_private_plain_attributes_back_so_the_users_numbers_stay_the_same() -> None:
    plain, traced, watched = _counted("plain"), _counted("trace"), _counted("watch")
    assert traced[:2] == plain[:2] and watched[:2] == plain[:2]  # same losses, the counter at 4
    assert plain[1] == 4
    # each step backs off, so watch replays it: the replay reads the counter the real forward left, computes
    # the other parity and says so, and sets the counter back
    assert watched[2] == ["not_reproduced"] * 4


def test_a_replay_that_raises_after_recording_a_non_finite_value_is_still_not_reproduced() -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    seen: set[int] = set()
    step = [0]

    def once(mod: nn.Module, args: Any, out: Any) -> None:
        if step[0] in seen:
            raise RuntimeError("hook ran twice in one step")
        seen.add(step[0])

    m[0].register_forward_hook(once)
    with warnings.catch_warnings(), _watch(m, optimizer=opt) as tr:
        warnings.simplefilter("ignore")
        for s in range(2):
            step[0] = s
            if s == 1:
                with torch.no_grad():
                    m[0].weight[0, 0] = float("inf")
            loss = m(torch.randn(2, 4)).sum()
            loss.backward()
            tr.step(loss=loss)
            opt.step()
            opt.zero_grad()
    assert tr.steps["recorded"].tolist() == ["watch", "not_reproduced"]
    assert "but replaying the step raised RuntimeError: hook ran twice in one step" in str(
        tr.first_overflow()
    )


def _walk_down(make: Any) -> nantrace.Trace:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), _PrivateCounter(), nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30)
    with make(m, optimizer=opt, scaler=scaler) as tr:
        for _ in range(24):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(torch.randn(4, 8)).float().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return tr


def test_a_benign_backoff_stays_benign_under_watch_when_a_call_counter_keeps_its_replays_from_reproducing() -> (
    None
):
    traced, watched = _walk_down(nantrace.trace), _walk_down(_watch)
    skipped = watched.steps["skipped"].astype(bool)
    assert skipped.tolist() == traced.steps["skipped"].astype(bool).tolist()
    n = int(skipped.sum())
    assert 0 < n < 24 and not skipped.iloc[n:].any()  # the scale walked down, then training proceeded
    assert watched.steps["recorded"].tolist() == ["not_reproduced"] * n + ["watch"] * (24 - n)
    assert traced.diagnose().cause == "scaler_backoff"
    d = watched.diagnose()
    assert (d.cause, d.summary) == (
        "scaler_backoff",
        f"Benign loss-scale backoff: the GradScaler skipped {n} step(s), then training proceeded.",
    )
    assert d.evidence[-1].startswith(f"nantrace.watch's replays of step(s) 0–{n - 1} did not reproduce them")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_gradient_from_outside_the_replayed_forward_is_not_blamed_on_the_optimizer() -> None:
    torch.manual_seed(0)
    m = _Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with _watch(m, optimizer=opt) as tr:
        for s in range(2):
            aux_in = torch.zeros(2, 4)
            aux_in[:, 0] = 2e38 if s == 1 else 1.0  # finite; b.weight.grad = 2 * 2e38 = inf in float32
            loss = (
                m(torch.randn(2, 4)).sum() + m.b(aux_in).sum()
            )  # an aux term through `b`, outside m's forward
            loss.backward()
            tr.step(loss=loss)
            opt.step()
            opt.zero_grad()
    assert tr.steps["recorded"].tolist() == ["watch", "not_reproduced"]
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.module, ov.tensor, ov.kind) == (
        1, "backward", "b", "weight.grad", "inf",
    )  # fmt: skip
    assert (
        "but the replay recorded none in the backward phase: its first non-finite value was in the optimizer"
        in (str(ov))
    )
    assert tr.diagnose().cause == "backward_overflow"


class _LogOfZero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.relu(self.fc(x)) + 1.0 - self.cut)  # log of 0 where relu is 0 and cut is 1


def test_a_singular_point_under_watch_gets_no_caveat_about_growth_on_watched_steps() -> None:
    torch.manual_seed(0)
    m = _LogOfZero()
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with _watch(m, optimizer=opt) as tr:
        for s in range(4):
            m.cut = 1.0 if s == 3 else 0.0
            loss = m(torch.randn(8, 4)).sum()
            loss.backward()
            tr.step(loss=loss)
            opt.step()
            opt.zero_grad()
    ov = tr.first_overflow()
    assert ov is not None and (ov.step, ov.phase, ov.module) == (3, "forward", "")
    d = tr.diagnose()
    assert d.cause == "invalid_op"
    assert not [
        line for line in [*d.evidence, *d.advice] if "watched" in line or "Before changing dtypes" in line
    ]
