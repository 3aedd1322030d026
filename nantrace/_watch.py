"""The leave-on mode of :func:`nantrace.watch`: a nearly free sentinel on every step, a full recording of the
step that goes non-finite (replayed from what the sentinel kept), and a full step every ``every`` steps.

A :class:`Watch` composes a :class:`~nantrace._recording.Recording` that records only on full steps and during a
replay; on the other steps its hooks below the root are out of their tables (:meth:`Recording.suspend_hooks
<nantrace._recording.Recording.suspend_hooks>`), so the model runs PyTorch's fast paths. On those steps the
sentinel keeps, per micro-step (root forward): the root's
inputs (detached references, their ``_version``), the CPU and accelerator RNG states, the autocast state and
grad mode at the root forward, and the gradients that arrive at the root's outputs, per backward pass (one
autograd graph task). Its flags are device tensors: one ``torch.aminmax`` per input and output tensor, per loss
and per output gradient (NaN propagates into the minimum and maximum, ±inf is the extreme, and a large finite
value cannot overflow it), one fused ``torch._foreach_norm`` over the gradients when a backward pass that reached
the root's outputs ends (an autograd engine callback: before the loop can clip them; at ``optimizer.step()``
when no such pass ran), read beside the GradScaler's found-inf (their L2 norms give ``steps.grad_norm``), and one
float32 sum per parameter after ``optimizer.step()`` (a finiteness flag, cheaper than a norm); at the first gradient of a step's backward, the number of parameters whose
``.grad`` already holds inf/NaN (``steps.stale_grads``: one fused float64 L2 norm over the ``.grad`` tensors that
exist then, none when the loop resets them to None). The flags are read once before ``optimizer.step()`` (where
the GradScaler reads its found-inf) and the parameter flag once at the step boundary, never inside a hook; each
read carries the tensors the step's ``steps`` row holds by then (loss, gradient norm, lr), whose values replace
them on a healthy step, so the flush copies nothing more for them. What is built from the parameter list
(paths, owners, the tensors checked) is built once per list, not per step.

When a flag is non-finite, every micro-step of the step is replayed with the recording on, before
``optimizer.step()`` changes the parameters: the root forward on the same inputs with the same RNG state,
autocast and grad mode, then ``torch.autograd.backward`` from the captured output gradients, one backward pass
at a time, in the order the real step ran them. A replayed forward whose root outputs differ from what the
sentinel saw of the real ones (smallest and largest values) computed something else (state it read had changed
since): the step is then not reproduced, and nothing the replay recorded is presented as its producer. ``.grad`` of every parameter, the module buffers (BatchNorm running statistics) and the RNG
states are saved before and restored after, so the user's run continues bit for bit. A non-finite parameter
after ``optimizer.step()`` is recorded as the ``optimizer`` phase rows of that step. The replay starts from no
``.grad``, so it records what the step's own backward made; a flagged gradient whose ``.grad`` was already
non-finite before the step (``stale_grads``) is reproduced when the replay's own values are finite.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import _store
from ._drill import issues_collectives, reset_call_site, set_call_site, user_line, user_stacklevel
from ._hooks import at_pass_end, eager, graph_task, in_backward
from ._naming import is_sharded
from ._scaler import current_lr, nested_step
from ._schema import PHASE_CODE, PHASES, RECORDED
from ._tree import flatten, host_rng_states, plain_state, restore_plain, set_host_rng_states

if TYPE_CHECKING:
    from ._recording import Recording

__all__ = ["DEFAULT_EVERY", "Watch"]

DEFAULT_EVERY = 100


@dataclass
class _Micro:
    """What the sentinel keeps of one root forward until the step ends."""

    args: Any
    kwargs: Any
    versions: tuple[int, ...]
    rng: torch.Tensor
    accel_rng: list[torch.Tensor] | None
    host_rng: tuple[Any, Any]  # Python's and NumPy's RNG states at the forward (a forward may draw from them)
    autocast: list[tuple[str, bool, torch.dtype]]
    grad_enabled: bool
    site: str | None = None  # the user's line that made the root call (a replay's ops are named at it)
    # the sum of the parameters' version counters at the forward: in-place writes only raise it, so a different
    # sum at the replay means the weights were written since (a replay would not compute what this forward did)
    weights: int = 0
    backward_after: int = -1  # number of root forwards done when its first output gradient arrived
    # the losses seen, and whether its output gradients had arrived by then (a loss given to ``tr.step`` after
    # ``loss.backward()``): the replay records each where the real step saw it
    losses: list[tuple[Any, bool]] = field(default_factory=list)


@dataclass
class _Pass:
    """One backward pass of a watched step (one autograd graph task: a ``.backward()`` or
    ``torch.autograd.grad`` call) that reached the root's outputs: the number of root forwards done when its
    first gradient arrived, and the gradients it brought, as ``(micro-step, output path, gradient)``."""

    after: int
    grads: list[tuple[int, str, torch.Tensor]] = field(default_factory=list)


@dataclass
class _Flag:
    """One sentinel check: a 1-d float tensor whose non-finite entries name ``paths[i]``."""

    phase: str
    micro: int
    paths: list[str]
    values: torch.Tensor
    owners: list[tuple[str, str]] | None = None  # (module, module_type) per path; None: the root / loss
    # the checked tensors (gradients, parameters), to tell a norm that overflowed from a non-finite element
    tensors: list[torch.Tensor] | None = None
    dtypes: list[str] | None = None  # per path, when ``tensors`` is None (model inputs, outputs, the loss)


def _detach(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        # a reference, not a copy; a replay's backward reaches these detached leaves, never the user's tensors
        grad = obj.requires_grad and (obj.is_floating_point() or obj.is_complex())
        return obj.detach().requires_grad_(grad)
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_detach(v) for v in obj)
    if isinstance(obj, list):
        return [_detach(v) for v in obj]
    if type(obj) is dict:
        return {k: _detach(v) for k, v in obj.items()}
    return obj


def _extremes(items: list[tuple[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor, list[str]] | None:
    """The minimum and maximum of each floating tensor (one fused ``torch.aminmax`` pass, in its own dtype:
    NaN propagates into both, ±inf shows as the extreme, a large finite value never overflows), stacked as
    ``[min0, max0, min1, max1, …]`` with each path (and its tensor's dtype) named twice; None if there is
    none. Sparse and other non-strided tensors are skipped, as the recording skips them."""
    paths: list[str] = []
    dtypes: list[str] = []
    ends: list[torch.Tensor] = []
    for path, t in items:
        if t.is_floating_point() and t.layout == torch.strided and t.numel() and type(t) is torch.Tensor:
            paths += (path, path)
            dtypes += [str(t.dtype).removeprefix("torch.")] * 2
            ends += torch.aminmax(t.detach())
    if not ends:
        return None
    device = ends[0].device
    wide = (
        torch.float64 if any(e.dtype == torch.float64 for e in ends) else torch.float32
    )  # 1e300 stays finite
    return paths, torch.stack([e.to(device=device, dtype=wide) for e in ends]), dtypes


def _norms(tensors: list[torch.Tensor], plain: bool = False) -> torch.Tensor:
    """Per-tensor L2 norms, fused (``torch._foreach_norm``), accumulated in float32 (float64 tensors in
    float64, which cannot be narrowed), on the first tensor's device. ``plain``: the caller knows that no
    tensor is float64 and all are on one device (one fused call and one stack, no per-tensor work)."""
    if plain:
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    wide = [i for i, t in enumerate(tensors) if t.dtype == torch.float64]
    if not wide:
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
        return torch.stack([n.to(norms[0].device) for n in norms])
    narrow = [i for i in range(len(tensors)) if i not in set(wide)]
    got = dict(zip(wide, torch._foreach_norm([tensors[i] for i in wide], 2), strict=True))
    if narrow:
        got.update(
            zip(
                narrow, torch._foreach_norm([tensors[i] for i in narrow], 2, dtype=torch.float32), strict=True
            )
        )
    device = tensors[0].device
    return torch.stack([got[i].to(device=device, dtype=torch.float64) for i in range(len(tensors))])


def _sums(tensors: list[torch.Tensor], plain: bool = False) -> torch.Tensor:
    """Per-tensor sums as finiteness flags (inf and NaN propagate into a sum; one pass, cheaper than an L2
    norm), accumulated in float32 (float64 tensors in float64), on the first tensor's device. A sum that
    overflows from finite values is told apart by :func:`_first_bad`. ``plain``: as for :func:`_norms`."""
    if plain:
        return torch.stack([t.sum(dtype=torch.float32) for t in tensors])
    device = tensors[0].device
    return torch.stack(
        [
            t.sum(dtype=t.dtype if t.dtype == torch.float64 else torch.float32).to(device, torch.float64)
            for t in tensors
        ]
    )


@dataclass
class _Params:
    """What the sentinel needs of ``Recording.params``, built once per parameter list (not per step): the
    parameters, the floating-point ones checked after ``optimizer.step()``, and whether one fused norm over
    them (or their gradients, which share their device and dtype) needs no per-tensor conversion."""

    last: Any  # the last entry of the list it was built from (a re-attach builds new entries)
    count: int
    tensors: list[nn.Parameter]
    floating: tuple[int, ...]
    checked: list[torch.Tensor]
    plain: bool

    def grads(self) -> tuple[list[int], list[torch.Tensor]]:
        """The indices and the dense floating-point ``.grad`` of the parameters that have one now."""
        index: list[int] = []
        grads: list[torch.Tensor] = []
        for i, p in enumerate(self.tensors):
            g = p.grad
            if g is not None and g.is_floating_point() and not g.is_sparse:
                index.append(i)
                grads.append(g.to_local() if is_sharded(g) else g)  # type: ignore[attr-defined]
        return index, grads

    @staticmethod
    def current(cached: _Params | None, params: list[tuple[nn.Parameter, int, int, str]]) -> _Params:
        """``cached`` if it was built from ``params`` as they are now, else a new one."""
        if cached is not None and cached.count == len(params) and (not params or cached.last is params[-1]):
            return cached
        return _Params.of(params)

    @staticmethod
    def of(params: list[tuple[nn.Parameter, int, int, str]]) -> _Params:
        tensors = [p for p, _, _, _ in params]
        floating = tuple(i for i, p in enumerate(tensors) if p.is_floating_point())
        plain = len({p.device for p in tensors}) <= 1 and all(p.dtype != torch.float64 for p in tensors)
        return _Params(
            params[-1] if params else None,
            len(params),
            tensors,
            floating,
            # a DTensor (FSDP2) is checked by this rank's shard: its local tensor, which the optimizer updates
            [tensors[i].to_local() if is_sharded(tensors[i]) else tensors[i] for i in floating],  # type: ignore[attr-defined]
            plain,
        )


_HELD = ("scale", "next_scale", "growth_tracker", "found_inf", "lr", "applied_norm")


def _held(pending: _store.PendingStep) -> list[tuple[str, Any, torch.Tensor]]:
    """The one-element tensors of the open step's ``steps`` row that the flush would read, as (field, key,
    tensor): ``key`` is the list index (losses), the dict key (grad_norms, stale) or None (a scalar field)."""
    out: list[tuple[str, Any, torch.Tensor]] = [
        ("losses", i, t)
        for i, t in enumerate(pending.losses)
        if isinstance(t, torch.Tensor) and t.numel() == 1
    ]
    out += [
        ("grad_norms", k, t)
        for k, t in pending.grad_norms.items()
        if isinstance(t, torch.Tensor) and t.numel() == 1
    ]
    out += [
        ("stale", k, t) for k, t in pending.stale.items() if isinstance(t, torch.Tensor) and t.numel() == 1
    ]
    for name in _HELD:
        v = getattr(pending, name)
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            out.append((name, None, v))
    return out


def _read(pending: _store.PendingStep, flags: list[_Flag]) -> tuple[_Flag, int, float] | None:
    """The one host copy of ``flags`` together with the tensors the open step's ``steps`` row holds; the first
    non-finite flag entry (see :func:`_first_bad`). On a healthy read the row's values are put in place of its
    tensors, so the flush at the step boundary copies nothing more for them; a flagged step keeps them (its
    replay adds to the row, and the flush reads it all as on a full step)."""
    held = _held(pending)
    n = sum(len(f.paths) for f in flags)
    host = _store.to_host([*(f.values for f in flags), *(t for _, _, t in held)])
    bad = _first_bad(flags, host[:n])
    if bad is None:
        _release(pending, held, host[n:])
    return bad


def _release(pending: _store.PendingStep, held: list[tuple[str, Any, torch.Tensor]], host: Any) -> None:
    """Put the host values of ``held`` (read with the sentinel's flags) in place of their tensors, so the
    step's flush has nothing left to copy for them (the same float64 values it would have read)."""
    for (name, key, _), v in zip(held, host, strict=True):
        if name == "losses":
            pending.losses[key] = float(v)
        elif name == "grad_norms":
            pending.grad_norms[key] = float(v)
        elif name == "stale":
            pending.stale[key] = float(v)
        else:
            setattr(pending, name, float(v))


def _autocast_state(devices: tuple[str, ...]) -> list[tuple[str, bool, torch.dtype]]:
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices]


def _found_inf(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    found = [
        v
        for st in getattr(scaler, "_per_optimizer_states", {}).values()
        for v in st.get("found_inf_per_device", {}).values()
    ]
    return torch.stack([f.to(found[0].device).float().sum() for f in found]).sum() if found else None


@contextlib.contextmanager
def _restored(model: nn.Module, params: list[nn.Parameter]) -> Iterator[None]:
    """Save ``.grad`` of ``params`` (set to None inside), the buffers of ``model``, the RNG states (torch's,
    Python's ``random``, NumPy's global) and the plain Python attributes of its modules
    (:func:`nantrace._tree.plain_state`: a call counter); restore them on exit."""
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    attributes = plain_state(model)
    cpu = torch.get_rng_state()
    host = host_rng_states()
    accel = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(cpu)
        set_host_rng_states(host)
        if accel is not None:
            torch.cuda.set_rng_state_all(accel)
        restore_plain(model, attributes)


class Watch:
    """The sentinel and the replay of one :func:`nantrace.watch` (see the module docstring).

    ``every``: a full step on steps 0, N, 2N, …; ``None``: never (only faulty steps are recorded).
    """

    def __init__(self, recording: Recording, every: int | None) -> None:
        self.r = recording
        self.every = every
        self.mode = "full"
        self.live = False
        self.replaying = False
        self.depth = 0
        self.eval_call = False
        self.micro: list[_Micro] = []
        self.passes: dict[int, _Pass] = {}  # graph task id -> the backward pass, in the order they came
        # the gradients' L2 norms as the last backward pass left them: (indices, gradients, norms)
        self.end_norms: tuple[list[int], list[torch.Tensor], torch.Tensor] | None = None
        self.flags: list[_Flag] = []
        self.param_flag: _Flag | None = None
        self.checked = False
        self.stale_checked = False
        self.recorded = "watch"
        self.opt_mode = "full"
        self.handles: list[RemovableHandle] = []
        self.tensor_handles: list[RemovableHandle] = []
        self.names: dict[Any, tuple[list[str], list[tuple[str, str]]]] = {}  # see _param_names
        self.param_set: _Params | None = None  # see _params
        self.autocast_devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
        self.sentinel: dict[str, dict[str, Any]] = {}  # step -> what the sentinel saw (steps it flagged)
        self.warned_no_forward = False
        recording.options["watch"] = {"every": every, "sentinel": self.sentinel}
        recording.add_step_observer(self._on_step_closed)

    # ------------------------------------------------------------------ attach / detach
    def enter(self) -> None:
        """Enter the recording and attach the sentinel's hooks (after the recording's own)."""
        r = self.r
        r.enter()
        root = r.root
        self.handles.append(root.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True))
        self.handles.append(root.register_forward_hook(self._post, with_kwargs=True, always_call=True))
        if r.optimizer is not None:
            self._hook_optimizer(r.optimizer)
        if r.scaler is not None:
            self._wrap_scaler(r.scaler)
        self.live = True
        self._begin(0)

    def exit(self, failed: bool) -> None:
        """Close the open step (checked and, if needed, replayed) and exit the recording."""
        try:
            if self.live and not failed and self.mode == "watch" and (self.micro or self.flags):
                self._close(self.r.end_step)
        finally:
            self.live = False
            for h in [*self.handles, *self.tensor_handles]:
                h.remove()
            self.handles.clear()
            self._reset()
            self.r.exit(failed)

    def bind(
        self, *, scaler: torch.amp.GradScaler | None = None, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """:meth:`Recording.bind <nantrace._recording.Recording.bind>`, and the sentinel's hooks on what it bound.

        Raises:
            NantraceError: the recording is not active (not entered, or closed).
        """
        r = self.r
        had_scaler, had_optimizer = r.scaler, r.optimizer
        r.bind(scaler=scaler, optimizer=optimizer)
        if r.optimizer is not None and had_optimizer is None:
            self._hook_optimizer(r.optimizer)
        if r.scaler is not None and had_scaler is None:
            self._wrap_scaler(r.scaler)

    def run_pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Run the sentinel's root pre-hook, then the recording's, by hand, in the order they run when
        attached (``nantrace run`` attaches during the root's first call, whose pre-hooks have already run)."""
        if module is self.r.root:
            self._pre(module, args, kwargs)
        self.r.run_pre_hook(module, args, kwargs)

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.handles.append(optimizer.register_step_pre_hook(self._opt_pre))
        self.handles.append(optimizer.register_step_post_hook(self._opt_post))

    def pause(self) -> None:
        """Check nothing and record nothing until :meth:`resume` (a callback between training steps)."""
        self.live = False
        self.r.pause()

    def resume(self) -> None:
        """Watch again after :meth:`pause`: the sentinel, and the recording on a full step."""
        if self.r.closed or not self.r.entered:
            return
        self.live = True
        if self.mode == "full":
            self.r.resume()

    def _wrap_scaler(self, scaler: torch.amp.GradScaler) -> None:
        inner_step, inner_update, inner_scale = scaler.step, scaler.update, scaler.scale

        def step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if self._watching() and scaler.is_enabled():
                state = scaler._per_optimizer_states[id(optimizer)]
                if state["stage"].name == "READY":
                    scaler.unscale_(optimizer)  # what step() does first; the grads are then checked unscaled
                self._check(_found_inf(scaler), scaled=False)
            return inner_step(optimizer, *args, **kwargs)

        def update(new_scale: Any = None) -> None:
            if self._watching():
                self._close(lambda: inner_update(new_scale))
            else:
                inner_update(new_scale)

        def scale(outputs: Any) -> Any:
            if self._watching():
                self._loss(outputs)
            return inner_scale(outputs)

        self.r.patch(scaler, "step", step)
        self.r.patch(scaler, "update", update)
        self.r.patch(scaler, "scale", scale)

    # ------------------------------------------------------------------ step structure
    def _watching(self) -> bool:
        return self.live and self.mode == "watch" and not self.replaying

    def _begin(self, step: int) -> None:
        self._reset()
        full = self.every is not None and step % self.every == 0
        self.mode = "full" if full else "watch"
        self.r.rec.active = full  # and a watched step runs without the hooks below the root:
        (self.r.resume_hooks if full else self.r.suspend_hooks)()

    def _reset(self) -> None:
        for h in self.tensor_handles:
            h.remove()
        self.tensor_handles.clear()
        self.micro, self.flags, self.param_flag = [], [], None
        self.passes, self.end_norms = {}, None
        self.checked = False
        self.stale_checked = False
        self.recorded = "watch"

    def _on_step_closed(self, recording: Recording, chunks: int, step: int, final: bool) -> None:
        if self.mode == "watch":
            self._mark(step)
        if self.live and not final:
            self._begin(step + 1)

    def _mark(self, step: int) -> None:
        """Write how ``step`` was recorded into its ``steps`` row (:func:`_recorded_as`)."""
        cols = self.r.store.step_rows.cols
        recorded = _recorded_as(self.recorded, self.sentinel, step, cols, self.r.store.chunks)
        cols["recorded"][-1] = float(RECORDED.index(recorded))
        if str(step) in self.sentinel:
            self.sentinel[str(step)]["recorded"] = recorded

    def step(self, loss: torch.Tensor | float | None) -> None:
        """``Trace.step`` under watch: the loss is checked; without scaler and optimizer the step closes.

        Raises:
            TypeError: ``loss`` is not a tensor, a Python number or None.
            NantraceError: not inside ``with``.
        """
        r = self.r
        if self.replaying:  # a hook in the replayed forward: the replay records the step's losses itself
            return
        if not self._watching():
            r.step(loss)
            return
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            loss = torch.tensor(float(loss))  # a loss already read with .item()
        if loss is not None and not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"loss must be a torch.Tensor, a Python float or None; got {type(loss).__name__}: {loss!r:.80}"
            )
        if loss is not None:
            self._loss(loss)
        if r.scaler is None and r.optimizer is None:
            self._close(lambda: r.step(None))

    def _close(self, finish: Callable[[], None]) -> None:
        """End a watched step: check (and replay) if not done yet, the post-step parameter check, then
        ``finish()`` with the recording on, which closes the step and writes its row."""
        r = self.r
        rec = r.rec
        if not self.micro and not self.warned_no_forward:
            self.warned_no_forward = True
            _warn_no_forward(rec.step, r.root)
        if not self.checked:
            self._check(None, scaled=r.scaler is not None)
        if self.param_flag is not None:
            bad = _read(
                rec.pending, [self.param_flag]
            )  # with the row's loss, lr and norms: the flush reads none
            if bad is not None and self.recorded != "not_replayed":  # no rows without the step's gradients
                self._note(bad)
                rec.active = True
                last = self.param_flag.micro  # the step's last micro-step, where trace's optimizer rows are
                for p, mcode, tcode, pname in r.params:
                    if (
                        p.grad is not None
                    ):  # as trace records them (:func:`nantrace._scaler.attach_optimizer`)
                        rec.add("optimizer", mcode, tcode, 0, pname, p, is_grad=False, parent=-1, micro=last)
                if self.recorded == "watch":
                    self.recorded = "post_step"
        rec.pending.micro_steps = max(rec.pending.micro_steps, len(self.micro))
        rec.active = True
        finish()
        if r.rec.active and self.mode == "watch":  # finish() did not close (e.g. a manual step merged)
            rec.active = False

    # ------------------------------------------------------------------ the sentinel's hooks
    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.live or self.replaying or in_backward():
            return
        self.depth += 1
        if self.depth > 1:
            return
        r = self.r
        self.eval_call = r.training() and not torch.is_grad_enabled()
        if self.eval_call:
            return
        if r.step_each_forward():
            if self.mode == "watch" and (self.micro or self.flags):
                self._close(r.end_step)
            elif self.mode == "full" and r.rec.step_open():
                r.end_step()
        if self.mode != "watch":
            return
        items = [*flatten(args, "input"), *flatten(kwargs, "input")]
        self.micro.append(
            _Micro(
                args=_detach(args),
                kwargs=_detach(kwargs),
                versions=tuple(t._version for _, t in items if not t.is_inference()),
                rng=torch.get_rng_state(),
                host_rng=host_rng_states(),
                accel_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
                autocast=_autocast_state(self.autocast_devices),
                grad_enabled=torch.is_grad_enabled(),
                site=user_line(),
                weights=_weights_version(self.r.params),
            )
        )
        self._flag("data", items)

    def _post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self.live or self.replaying or in_backward():
            return
        self.depth = max(0, self.depth - 1)
        if self.depth or self.eval_call or self.mode != "watch" or not self.micro:
            return
        items = list(flatten(output, "output"))
        self._flag("forward", items)
        if not torch.is_grad_enabled():
            return
        micro = self.micro[-1]
        for path, t in items:
            if t.requires_grad and t.is_floating_point():
                self.tensor_handles.append(t.register_hook(self._grad_hook(micro, len(self.micro) - 1, path)))

    def _grad_hook(self, micro: _Micro, index: int, path: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if not self.live or self.replaying:
                return
            if not self.stale_checked:
                self._stale_check()
            _captured(self, micro, index, path, grad)
            head = "grad_output" + path[len("output") :] if path != "output" else "grad_output[0]"
            self._flag("loss", [(head, grad)], micro=index)

        return eager(hook)

    def _stale_check(self) -> None:
        """At the first gradient of a watched step's backward: :func:`_count_stale` into the open step."""
        self.stale_checked = True
        r = self.r
        if "backward" in r.rec.phases:  # as trace: else not recorded
            self.param_set = _Params.current(self.param_set, r.params)
            r.rec.pending.stale[-1] = _count_stale(self.param_set)

    def record_loss(self, loss: Any) -> None:
        """A loss seen by a front-end (``nantrace run`` sees ``loss.backward()``): checked on a watched step,
        recorded on a full one; nothing while paused."""
        if self._watching():
            self._loss(loss)
        elif self.live and not self.replaying:
            self.r.record_loss(loss)

    def _loss(self, loss: Any) -> None:
        items = [(p, t) for p, t in flatten(loss, "loss") if t.is_floating_point() and t.numel()]
        micro = self.micro[-1] if self.micro else None
        for _, t in items:
            self.r.rec.pending.losses.append(t.detach().float().mean())
        if micro is not None and items:
            micro.losses.append((_detach(loss), micro.backward_after >= 0))
        self._flag("loss", items)

    def _flag(self, phase: str, items: list[tuple[str, torch.Tensor]], micro: int | None = None) -> None:
        got = _extremes(items)
        if got is not None:
            index = len(self.micro) - 1 if micro is None else micro
            self.flags.append(_Flag(phase, max(index, 0), got[0], got[1], dtypes=got[2]))

    def _opt_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if nested_step():
            return
        self.opt_mode = self.mode  # the recording's post-hook may close a full step before ours runs
        if self._watching() and not self.checked:
            self._check(None, scaled=False)

    def _opt_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._watching() or self.opt_mode != "watch" or nested_step():
            return
        r = self.r
        ps = self.param_set = _Params.current(self.param_set, r.params)
        # only parameters with a gradient: optimizer.step() updates no other (a frozen mask, an unused weight)
        stepped = tuple(i for i in ps.floating if ps.tensors[i].grad is not None)
        if stepped:
            full = len(stepped) == len(ps.floating)
            checked = ps.checked if full else [ps.checked[ps.floating.index(i)] for i in stepped]
            paths, owners = _param_names(self.r, self.names, stepped, "")
            with torch.no_grad():
                values = _sums(checked, ps.plain)
            self.param_flag = _Flag("optimizer", max(len(self.micro) - 1, 0), paths, values, owners, checked)
        if opt.param_groups:
            r.rec.pending.lr = current_lr(opt)
        if r.scaler is None and not r.manual_steps:
            self._close(r.end_step)

    # ------------------------------------------------------------------ check and replay
    def _check(self, found_inf: torch.Tensor | None, *, scaled: bool) -> None:
        """The gradient check, then the one read of this step's flags; a replay if one is non-finite."""
        self.checked = True
        r = self.r
        got, self.end_norms = self.end_norms, None
        if got is None:  # no backward reached the root's outputs: the gradients as they are now
            got = _grad_norms(self)
        else:
            scaled = True  # as the backward left them: times the loss scale, as recorded
        index, grads, norms = got
        if grads:
            with torch.no_grad():
                total = torch.linalg.vector_norm(norms)
                scale = r.scaler._scale if r.scaler is not None and r.scaler.is_enabled() else None
                if not scaled and scale is not None:
                    total = total * scale.to(total.device)  # the store divides by the scale it used
            paths, owners = _param_names(self.r, self.names, tuple(index), ".grad")
            r.rec.pending.grad_norms = {0: total}
            micro = max(len(self.micro) - 1, 0)
            self.flags.append(_Flag("backward", micro, paths, norms, owners, grads))
        if found_inf is not None:
            flagged = torch.where(found_inf.reshape(1) > 0, math.inf, 0.0)
            self.flags.append(_Flag("backward", max(len(self.micro) - 1, 0), ["found_inf"], flagged))
        bad = _read(r.rec.pending, self.flags)
        if bad is not None:
            self._note(bad)
            self._replay()

    def _note(self, bad: tuple[_Flag, int, float]) -> None:
        step = self.r.rec.step
        if str(step) not in self.sentinel:  # the first flagged value of the step
            self.sentinel[str(step)] = _note_of(bad, step, type(self.r.root).__name__)

    def _replay(self) -> None:
        """Record every micro-step of this step again, with the recording on and nothing of the user's
        changed (see the module docstring)."""
        r = self.r
        self.recorded = "replay"
        if not self.micro:  # the loop did not call the watched model this step: nothing to replay
            self.sentinel[str(r.rec.step)]["no_forward"] = True
            self.recorded = "not_replayed"
            return
        now = [
            tuple(
                t._version
                for _, t in [*flatten(m.args, "i"), *flatten(m.kwargs, "i")]
                if not t.is_inference()
            )
            for m in self.micro
        ]
        note = self.sentinel[str(r.rec.step)]
        if any(v != m.versions for v, m in zip(now, self.micro, strict=True)):
            note["inputs_changed"] = True
        weights = _weights_version(r.params)
        written = [k for k, m in enumerate(self.micro) if m.weights != weights]
        if written:  # written in place after that forward (before optimizer.step(), which comes later)
            note["weights_changed"] = written
        if issues_collectives(r.root):  # FSDP/DDP: a replay on this rank alone would wait for the others
            self.recorded = "not_replayed"
            return
        _replay_step(self, note)


def _warn_no_forward(step: int, root: nn.Module) -> None:
    """Once per run: a watched step closed without a call of the watched model (the loop calls submodules)."""
    warnings.warn(
        f"nantrace.watch: step {step} ended without a call of the model it watches ({type(root).__name__}): the "
        "sentinel checks that model's inputs and outputs, so a loop that calls its submodules itself is seen only "
        "through the loss it gives tr.step(), its gradients and parameters, and a step that goes non-finite cannot "
        "be replayed. Pass watch() the module the loop calls, or use nantrace.trace()",
        stacklevel=user_stacklevel(),
    )


def _captured(w: Watch, micro: _Micro, index: int, path: str, grad: torch.Tensor) -> None:
    """A gradient that arrived at output ``path`` of micro-step ``index``: kept in its backward pass (one per
    autograd graph task, in the order they came); a new pass also has :func:`_grad_norms` taken when it ends
    (before the loop can clip the gradients), for ``steps.grad_norm`` and the gradient check."""
    task = graph_task()
    p = w.passes.get(task)
    if p is None:
        p = w.passes[task] = _Pass(len(w.micro))
        at_pass_end(functools.partial(_take_end_norms, w))
    p.grads.append((index, path, grad))
    if micro.backward_after < 0:
        micro.backward_after = len(w.micro)


def _take_end_norms(w: Watch) -> None:
    """At the end of a watched step's backward pass: :func:`_grad_norms` into ``w.end_norms`` (never raising
    into the user's backward: the check then takes them at ``optimizer.step()``)."""
    if w.live and not w.replaying and w.mode == "watch":
        try:
            w.end_norms = _grad_norms(w)
        except Exception:
            w.end_norms = None


def _grad_norms(w: Watch) -> tuple[list[int], list[torch.Tensor], torch.Tensor]:
    """``(indices, gradients, per-gradient L2 norms)`` of the parameters that have a ``.grad`` now."""
    ps = w.param_set = _Params.current(w.param_set, w.r.params)
    index, grads = ps.grads()
    if not grads:
        return index, grads, torch.zeros(0)
    with torch.no_grad():
        return index, grads, _norms(grads, ps.plain)  # a gradient has its parameter's device and dtype


def _replay_step(w: Watch, note: dict[str, Any]) -> None:
    """Replay the watched step ``w`` (its micro-steps, then its backward passes) with the recording on, inside
    :func:`_restored`; the step's ``steps`` row keeps what the real step had (its gradients' norms and stale
    counts, not the replay's). A replayed forward whose root outputs differ from the real one's
    (``note["outputs_differ"]``) or a replay that raised (``note["replay_failed"]``) is noted."""
    r = w.r
    pending = r.rec.pending
    kept = (dict(pending.grad_norms), dict(pending.stale), dict(pending.grad_versions))
    w.replaying = True
    r.rec.active = True
    r.resume_hooks()
    try:
        with _restored(r.root, list(r.root.parameters())):
            differ = _replay_micro_steps(r, w.micro, list(w.passes.values()), w.flags)
        if differ:
            note["outputs_differ"] = differ
    except Exception as e:  # never raise into the user's loop
        note["replay_failed"] = f"{type(e).__name__}: {e}"[:300]
        warnings.warn(
            f"nantrace.watch could not replay step {r.rec.step} ({e!r}); first_overflow() reports what the "
            "replay recorded before it failed, or where the sentinel saw the value if it recorded nothing",
            stacklevel=3,
        )
    finally:
        w.replaying = False
        r.rec.active = False
        r.suspend_hooks()  # a replay runs on watched steps only
        pending.grad_norms, pending.stale, pending.grad_versions = kept


def _recorded_as(
    recorded: str, sentinel: dict[str, dict[str, Any]], step: int, cols: dict[str, Any], chunks: Any
) -> str:
    """How ``step`` was recorded, from how it was meant to be (``recorded``) and what its replay recorded (the
    step row's ``cols``): a replay whose inputs or weights were written in place after a forward, or that
    recorded no non-finite value (unless :func:`_explained` says what it was), or whose first one came later
    than what the sentinel saw, did not reproduce the fault. A replayed -inf the mask rule judged a mask drops
    the step's note."""
    note = sentinel.get(str(step))
    if recorded == "replay" and note is not None and note.get("replay_failed"):
        return "not_reproduced"  # what it recorded before it raised is not the step
    if recorded == "replay" and note is not None and _changed(note) and cols["n_nonfinite"][-1] > 0:
        note["replay_unused"] = True  # a replay on other inputs or weights computes something else
        return "not_reproduced"
    if recorded == "replay" and note is not None and cols["n_nonfinite"][-1] > 0:
        later = _later_than_seen(chunks, step, note)
        if later is not None:  # the replay made values the sentinel never saw first
            note["replay_first"] = later
            return "not_reproduced"
    elif recorded in ("replay", "post_step") and cols["n_nonfinite"][-1] == 0:
        if note is not None and note.get("value") == "-inf" and _recorded_neginf(chunks, step):
            del sentinel[str(step)]  # the replay recorded the -inf, and the mask rule judged it a mask
        elif not _explained(note, cols["stale_grads"][-1]):
            return "not_reproduced"
    return recorded


def _recorded_neginf(chunks: list[dict[str, np.ndarray]], step: int) -> bool:
    """``step``'s rows (its chunk, the last one) hold a -inf: with no row counted non-finite, the mask rule
    judged every one a mask."""
    if not chunks or not len(chunks[-1]["step"]):
        return False
    c = chunks[-1]
    return bool(((c["n_neginf"] > 0) & (c["step"] == step)).any())


def _weights_version(params: list[tuple[nn.Parameter, int, int, str]]) -> int:
    """The sum of the parameters' version counters (each in-place write raises one by at least 1); an inference
    tensor has none and is left out."""
    return sum(p._version for p, _, _, _ in params if not p.is_inference())


def _changed(note: dict[str, Any]) -> bool:
    """The step's inputs or weights were written in place after one of its forwards, before the replay."""
    return bool(note.get("inputs_changed") or note.get("weights_changed") or note.get("outputs_differ"))


def _note_of(bad: tuple[_Flag, int, float], step: int, root_type: str) -> dict[str, Any]:
    """What the sentinel saw first at ``step`` (the flag entry ``bad``): the note saved with the trace."""
    f, i, v = bad
    module, module_type = (
        f.owners[i]
        if f.owners
        else ("", "loss" if f.phase == "loss" and f.paths[i].startswith("loss") else root_type)
    )
    if f.paths[i] == "found_inf":
        module, module_type = "", "GradScaler"
    dtype = (
        f.dtypes[i]
        if f.dtypes
        else str(f.tensors[i].dtype).removeprefix("torch.")
        if f.tensors is not None and i < len(f.tensors) and f.paths[i] != "found_inf"
        else ""
    )
    return {
        "step": step,
        "micro_step": f.micro,
        "phase": f.phase,
        "module": module,
        "module_type": module_type,
        "tensor": f.paths[i],
        "kind": "nan" if math.isnan(v) else "inf",
        "value": "nan" if math.isnan(v) else "inf" if v > 0 else "-inf",
        "dtype": dtype,
        "recorded": "replay",
    }


def _count_stale(ps: _Params) -> torch.Tensor | float:
    """How many parameters' ``.grad`` hold inf/NaN now, at the first gradient of a step's backward (it arrives at
    the model's outputs before any parameter's gradient of that backward is accumulated): a loop that never
    resets them keeps an earlier step's overflow there (``steps.stale_grads``). One fused L2 norm per existing
    ``.grad``, accumulated in float64: inf/NaN propagate into it, and no finite float16, bfloat16 or float32
    tensor can overflow it (a float32 L2 norm overflows from elements near 1e19); a float64 ``.grad``, whose own
    L2 norm could overflow, gets its largest ``|g|``. Fused L2 rather than the largest ``|g|``: CPU's fused
    ord=inf is 16x slower (3.9 ms against 0.24 ms in float32 and 2.2 ms in float64, model a's 3.2 M gradient
    elements). Counted on the device, read with the step's flags; nothing is kept of the gradients. 0.0 when no
    ``.grad`` exists (reset to None)."""
    _, grads = ps.grads()
    if not grads:
        return 0.0
    with torch.no_grad():
        if ps.plain:
            return (
                torch.logical_not(
                    torch.isfinite(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)))
                )
                .sum()
                .float()
            )
        # a float64 .grad could overflow its own L2 norm: its largest |g| instead (rare; no fused speed needed)
        narrow = [g for g in grads if g.dtype != torch.float64]
        norms = list(torch._foreach_norm(narrow, 2, dtype=torch.float64)) if narrow else []
        norms += [g.abs().amax() if g.numel() else g.new_zeros(()) for g in grads if g.dtype == torch.float64]
        device = norms[0].device
        wide = torch.stack([n.to(device) for n in norms])
        return torch.logical_not(torch.isfinite(wide)).sum().float()


def _explained(note: dict[str, Any] | None, stale: float) -> bool:
    """A replay that recorded no non-finite value still reproduced its step when the flagged value was a
    gradient that already held inf/NaN before the step's backward (``stale`` such parameters: the replay starts
    from no ``.grad``, so it records what the step's own backward added, and that was finite), or only the
    GradScaler's found-inf was set while the sentinel's check of this model's gradients was finite (the inf was
    in gradients outside the traced parameters, e.g. another model sharing the scaler). Says which in ``note``."""
    if note is None:
        return False
    if note["phase"] == "backward" and stale > 0:
        note["carried_over"] = int(stale)
        return True
    if note["tensor"] == "found_inf":
        note["outside"] = True
        return True
    return False


def _param_names(
    r: Recording,
    cache: dict[Any, tuple[list[str], list[tuple[str, str]]]],
    index: tuple[int, ...],
    suffix: str,
) -> tuple[list[str], list[tuple[str, str]]]:
    """The paths (parameter name + ``suffix``) and owners (module, module_type) of the parameters at ``index``
    in ``r.params``, built once per distinct set and kept in ``cache`` (no Python work per parameter per
    step)."""
    key = (index, suffix)
    got = cache.get(key)
    if got is None:
        params = [r.params[i] for i in index]
        got = (
            [name + suffix for *_, name in params],
            [(r.store.modules.values[m], r.store.types.values[t]) for _, m, t, _ in params],
        )
        cache[key] = got
    return got


def _replay_micro_steps(
    r: Recording, micros: list[_Micro], passes: list[_Pass], flags: list[_Flag]
) -> list[int]:
    """Run the root forward of every micro-step again (its RNG state, autocast and grad mode restored), record
    its losses, and run each backward pass where the real step ran it (after the forward it followed, in the
    order they came); a loss seen after its backward is recorded after the replayed backward, so the rows keep
    the real step's time order. Returns the micro-steps whose replayed root outputs differ from what the
    sentinel saw of the real ones (their smallest and largest values, ``flags``): state the forward read had
    changed since (a buffer or attribute the forward or the loop set, the training flag, global state)."""
    outputs: dict[int, Any] = {}
    differ: list[int] = []
    seen = {f.micro: f for f in flags if f.phase == "forward"}
    for k, m in enumerate(micros):
        torch.set_rng_state(m.rng)
        set_host_rng_states(m.host_rng)
        if m.accel_rng is not None:
            torch.cuda.set_rng_state_all(m.accel_rng)
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in m.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.set_grad_enabled(m.grad_enabled))
            token = set_call_site(sys._getframe(), m.site)
            try:
                outputs[k] = r.root(*m.args, **m.kwargs)
            finally:
                reset_call_site(token)
        if k in seen and not _same_extremes(seen[k], outputs[k]):
            differ.append(k)
        for loss, late in m.losses:
            if not late:
                r.record_loss(loss)
        for p in passes:
            if p.after == k + 1:
                _replay_backward(r, outputs, p)
        for mj in micros:
            if mj.backward_after == k + 1:
                for loss, late in mj.losses:
                    if late:  # seen after its backward (``tr.step(loss)`` after ``loss.backward()``)
                        r.record_loss(loss)
    return differ


def _same_extremes(flag: _Flag, output: Any) -> bool:
    """The replayed root ``output`` has the smallest and largest values the sentinel's ``flag`` saw of the real
    one (NaN equal to NaN): one host read, on a replayed step only."""
    got = _extremes(list(flatten(output, "output")))
    if got is None:
        return not flag.paths
    paths, values, _ = got
    if paths != flag.paths:
        return False
    a, b = _store.to_host([flag.values, values]).reshape(2, -1)
    return bool(np.array_equal(a, b, equal_nan=True))


def _later_than_seen(chunks: list[dict[str, np.ndarray]], step: int, note: dict[str, Any]) -> str | None:
    """The phase of the replay's first non-finite row when it is later than the phase where the sentinel saw
    one: the replay did not reproduce what the sentinel saw (a forward that depends on Python state, a
    non-deterministic kernel, a gradient that reached the parameters from outside the replayed forward), and
    its later rows (the real step's loss, the parameters after ``optimizer.step()``) are consequences, not
    producers. None otherwise."""
    seen = PHASE_CODE.get(str(note.get("phase")), len(PHASE_CODE))
    if not chunks or not len(chunks[-1]["step"]):
        return None
    c = chunks[-1]
    bad = ((c["n_nan"] + c["n_posinf"] + c["n_neginf"]) > 0) & (c["step"] == step)
    if not bad.any():
        return None
    first = int(c["phase"][bad].min())
    return PHASES[first] if first > seen else None


def _replay_backward(r: Recording, outputs: dict[int, Any], p: _Pass) -> None:
    """The backward pass ``p`` again: ``torch.autograd.backward`` from the replayed outputs with the gradients
    the real outputs received in it from outside the model (:func:`_external_grads`: an output computed from
    another output, as a loss from the logits returned beside it, already sends that one its share). The graph
    is kept for a later pass that runs through the same forward."""
    tensors, grads = [], []
    by_micro = {j: dict(flatten(out, "output")) for j, out in outputs.items()}
    for j, path, g in p.grads:
        t = by_micro.get(j, {}).get(path)
        if t is not None and t.requires_grad:
            tensors.append(t)
            grads.append(g)
    if len(tensors) > 1:  # one output sends no share to another
        r.rec.active = False  # the shares are computed by a backward of their own: not recorded
        try:
            grads = _external_grads(tensors, grads)
        finally:
            r.rec.active = True
    if tensors:
        torch.autograd.backward(tensors, grads, retain_graph=True)


def _reachable(start: Any) -> set[int]:
    """The ids of the autograd nodes reachable from ``start`` by ``next_functions`` (``start`` included)."""
    seen: set[int] = set()
    todo = [start]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        todo.extend(n for n, _ in getattr(node, "next_functions", ()))
    return seen


def _external_grads(tensors: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradient each output received from outside the model: the captured total minus what the outputs
    computed from it sent it (HF models return ``loss`` and the ``logits`` it was computed from; the hook on
    ``logits`` saw the loss's share). Outputs are taken downstream first; no value is read on the host. Without
    this the replay's backward counts that share twice. One walk of the graph per output."""
    nodes = [t.grad_fn for t in tensors]
    n = len(tensors)
    reach = [_reachable(node) for node in nodes]
    below = [
        [i != j and nodes[j] is not None and id(nodes[j]) in reach[i] for j in range(n)] for i in range(n)
    ]
    order: list[int] = []
    while len(order) < n:  # j after every i that depends on it
        ready = [j for j in range(n) if j not in order and all(i in order for i in range(n) if below[i][j])]
        if not ready:  # a cycle cannot happen in autograd; keep the captured gradients if it did
            return grads
        order.extend(ready)
    external: dict[int, torch.Tensor] = {}
    for j in order:
        ups = [i for i in order if below[i][j] and i in external]
        g = grads[j]
        if ups:
            share = torch.autograd.grad(
                [tensors[i] for i in ups],
                [tensors[j]],
                [external[i] for i in ups],
                retain_graph=True,
                allow_unused=True,
            )[0]
            if share is not None:  # equal elements (an inf the share made) leave nothing external
                g = torch.where(g == share, torch.zeros_like(g), g - share)
        external[j] = g
    return [external[j] for j in range(n)]


def _first_bad(flags: list[_Flag], host: np.ndarray) -> tuple[_Flag, int, float] | None:
    """The first flag entry that is NaN or +inf (a ``-inf`` input is an attention mask), from ``host``: the
    flags' values as read, in order. An entry over checked tensors (a gradient's norm, a parameter's sum) is
    read again from the tensor's elements: a norm or sum of large finite values can overflow (not a fault), and
    the elements give the kind (+inf, then -inf, before NaN, as the locator orders them)."""
    if not flags or bool(np.isfinite(host).all()):
        return None  # the healthy step: one vectorized test, no Python work per entry
    pos = 0
    for f in flags:
        for i in range(len(f.paths)):
            v = float(host[pos + i])
            if f.tensors is not None and not math.isfinite(v):
                v = _element_kind(f.tensors[i])
            if math.isnan(v) or (v == math.inf) or (v == -math.inf and f.phase != "data"):
                return f, i, v
        pos += len(f.paths)
    return None


def _element_kind(t: torch.Tensor) -> float:
    """``inf``, ``-inf`` or ``nan`` for the first kind ``t`` holds in that order, 0.0 when every element is
    finite (one host read; only on a step that flagged)."""
    with torch.no_grad():
        pos, neg, nan = _store.to_host(
            [torch.isposinf(t).any(), torch.isneginf(t).any(), torch.isnan(t).any()]
        )
    return math.inf if pos else -math.inf if neg else math.nan if nan else 0.0
