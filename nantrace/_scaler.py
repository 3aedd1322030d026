"""The hooks a recording owns beside the module hooks: parameter gradients, the reduced gradients of a
distributed run, the optimizer's step hooks and the thin wraps of ``GradScaler.scale``/``update``/``unscale_``.

Each function takes the :class:`~nantrace._recording.Recording` it records into.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ._hooks import at_pass_end, eager, graph_task

if TYPE_CHECKING:
    from ._recording import Recording

__all__ = [
    "applied_norm",
    "attach_optimizer",
    "attach_scaler",
    "current_lr",
    "nested_step",
    "param_hook",
    "scaler_tensor",
    "stale_hook",
]


def scaler_tensor(scaler: torch.amp.GradScaler, attr: str) -> torch.Tensor | float | None:
    """A copy of the scaler's ``_scale`` or ``_growth_tracker`` (a device tensor: read at the step boundary)."""
    v = getattr(scaler, attr, None)
    if isinstance(v, torch.Tensor):
        return v.detach().clone().float()
    if attr == "_scale":
        return float(scaler.get_scale())
    return None


def current_lr(optimizer: torch.optim.Optimizer) -> Any:
    """The learning rate of the first param group (a tensor lr is copied, not read)."""
    lr = optimizer.param_groups[0].get("lr")
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr


def _grad_norm(g: torch.Tensor) -> torch.Tensor:
    g = g.detach()
    wide = g if g.dtype in (torch.float32, torch.float64) else g.float()
    return torch.linalg.vector_norm(wide)


def param_hook(
    r: Recording, mcode: int, tcode: int, pname: str, index: int
) -> Callable[[torch.Tensor], None]:
    """The post-accumulate-grad hook of parameter ``index``: its gradient's row and L2 norm."""
    rec = r.rec
    path = pname + ".grad"
    sharded = index in r.sharded_params

    def hook(p: torch.Tensor) -> None:
        g = p.grad
        if not rec.active or g is None or not g.is_floating_point() or g.is_sparse:
            return
        if sharded:  # FSDP2: the reduce-scattered gradient; this rank's shard
            g = g.to_local()  # type: ignore[attr-defined]
        rec.add("backward", mcode, tcode, 0, path, g, is_grad=True, parent=-1, reduced=sharded)
        if not sharded and not g.is_inference():  # (a shard is a new tensor each time: never reused)
            rec.pending.grad_versions[index] = (weakref.ref(g), g._version)
            if _norms_at_pass_end(rec.pending):
                return
        rec.pending.grad_norms[index] = _grad_norm(g)

    return eager(hook)


def _norms_at_pass_end(pending: Any) -> bool:
    """Queue, once per backward pass, :func:`_pass_norms` for when the pass ends (:func:`at_pass_end`): one
    fused reduction over the gradients hooked in the step instead of one per parameter. False when it cannot be
    queued (the gradient's norm is then taken at once)."""
    task = graph_task()
    if pending.norms_task == task != -1:
        return True
    if not at_pass_end(lambda: _pass_norms(pending)):
        return False
    pending.norms_task = task
    return True


def _pass_norms(pending: Any) -> None:
    """The L2 norm of each gradient the step's parameter hooks saw (``pending.grad_versions``), as the backward
    pass left it: fused per device (``torch._foreach_norm``), accumulated in float32 (float64 gradients in
    float64), into ``pending.grad_norms``. Never raises into the backward: a gradient whose norm could not be
    taken fused gets its own."""
    groups: dict[tuple[torch.device, bool], list[tuple[int, torch.Tensor]]] = {}
    for i, (ref, _) in pending.grad_versions.items():
        g = ref()
        if g is not None:
            groups.setdefault((g.device, g.dtype == torch.float64), []).append((i, g.detach()))
    with torch.no_grad():
        for (_, wide), items in groups.items():
            norms: Sequence[torch.Tensor]
            try:
                grads = [g for _, g in items]
                norms = (
                    torch._foreach_norm(grads, 2)
                    if wide
                    else torch._foreach_norm(grads, 2, dtype=torch.float32)
                )
            except Exception:
                norms = [_grad_norm(g) for _, g in items]
            for (i, _), n in zip(items, norms, strict=True):
                pending.grad_norms[i] = n


def applied_norm(r: Recording) -> None:
    """At the start of ``optimizer.step()``: the L2 norm of the traced parameters' gradients it is about to
    apply (unscaled by then under a GradScaler, and after any clipping the loop did), one on-device reduction
    kept as a device tensor (``steps.applied_grad_norm``, read at the step boundary)."""
    rec = r.rec
    if not rec.active or "backward" not in rec.phases:
        return
    grads = []
    same = True  # every gradient is the one whose norm the post-accumulate hook took, unchanged since
    seen = rec.pending.grad_versions
    for i, (p, _, _, _) in enumerate(r.params):
        g = p.grad
        if g is None or not g.is_floating_point() or g.is_sparse:
            continue
        entry = seen.get(i)
        same = same and entry is not None and entry[0]() is g and entry[1] == g._version
        if i in r.sharded_params:
            g = g.to_local()  # type: ignore[attr-defined]
        grads.append(g.detach())
    if not grads:
        return
    if same and rec.pending.scale is None and len(rec.pending.grad_norms) == len(grads):
        # nothing (no clipping, no unscaling, no all-reduce) changed them after their norms were taken: the norm
        # optimizer.step() applies is grad_norm, with no second pass over every gradient
        rec.pending.applied_same = True
        return
    devices = {g.device for g in grads}
    if len(devices) > 1:
        return  # parameters on several devices: not one reduction, left unknown
    # float16/bfloat16/float32 norms accumulated in float32 (no float32 copy of a float16 gradient, no float16
    # overflow of the norm); float64 ones in float64 (foreach refuses to narrow them)
    narrow = [g for g in grads if g.dtype != torch.float64]
    wide = [g for g in grads if g.dtype == torch.float64]
    norms = list(torch._foreach_norm(narrow, 2, dtype=torch.float32)) if narrow else []
    norms += [n.float() for n in torch._foreach_norm(wide)] if wide else []
    rec.pending.applied_norm = torch.linalg.vector_norm(torch.stack(norms))


def stale_hook(r: Recording, p: torch.Tensor, index: int) -> Callable[[torch.Tensor], None]:
    """The pre-accumulation hook of parameter ``index`` (``Tensor.register_hook``: it sees the fresh gradient
    while ``p.grad`` still holds what the loop left there). The first time a step's backward reaches the
    parameter, a device flag of whether that old ``.grad`` held inf/NaN (a loop that never calls ``zero_grad()``
    keeps an earlier step's inf there); read at the step boundary. The gradient is returned unchanged."""
    rec = r.rec
    ref = weakref.ref(p)
    sharded = index in r.sharded_params

    def hook(grad: torch.Tensor) -> None:
        pending = rec.pending
        if not rec.active or index in pending.stale:
            return
        q = ref()
        old = q.grad if q is not None else None
        if sharded or old is None or not old.is_floating_point() or old.is_sparse:
            pending.stale[index] = None
            return
        pending.stale[index] = torch.logical_not(torch.isfinite(old.detach())).any().float()

    return eager(hook)


def record_reduced(r: Recording) -> None:
    """Once per step, after backward: each parameter's gradient after DDP's all-reduce (``reduced=True``
    rows; ``steps.grad_norm`` then is the norm of these, what the optimizer applies)."""
    rec = r.rec
    if not rec.active or r.reduced_done:
        return
    r.reduced_done = True
    rec.cache.clear()  # the same .grad tensor now holds other values: no cached statistics
    for i, (p, mcode, tcode, pname) in enumerate(r.params):
        g = p.grad
        if i in r.sharded_params or g is None or not g.is_floating_point() or g.is_sparse:
            continue
        rec.add("backward", mcode, tcode, 0, pname + ".grad", g, is_grad=True, parent=-1, reduced=True)
        rec.pending.grad_norms[i] = _grad_norm(g)


def _records_reduced(r: Recording) -> bool:
    return r.world_size > 1 and "backward" in r.rec.phases


# the code of torch's wrapper that runs an optimizer's step hooks around its step()
_STEP_WRAPPER = torch.optim.Optimizer.profile_hook_step(lambda: None).__code__


def nested_step() -> bool:
    """True inside a step() that another step() of the same optimizer called: torch runs the step hooks again
    for every patched ``step`` on the stack (a subclass whose ``step`` calls ``super().step()``, when the base
    class was instantiated too), and only the outermost call is the training step. Read from the Python stack
    (two frames of torch's hook wrapper), so a step() that raised leaves nothing behind."""
    frame: types.FrameType | None = sys._getframe(1)
    seen = 0
    while frame is not None:
        if frame.f_code is _STEP_WRAPPER:
            seen += 1
            if seen > 1:
                return True
        frame = frame.f_back
    return False


def attach_optimizer(r: Recording, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's step post-hook (parameters after ``step()``, those with a ``.grad`` only; lr, the step
    boundary without a scaler)
    and, in a distributed run, its step pre-hook (the reduced gradients)."""

    def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        rec = r.rec
        if not rec.active or nested_step():
            return
        if "optimizer" in rec.phases:
            for p, mcode, tcode, pname in r.params:
                # a parameter without a gradient is one optimizer.step() did not update (torch's optimizers skip
                # it): a frozen weight, a mask kept as a parameter, a weight unused this step
                if p.grad is not None:
                    rec.add("optimizer", mcode, tcode, 0, pname, p, is_grad=False, parent=-1)
        if opt.param_groups:
            rec.pending.lr = current_lr(opt)
        if r.scaler is None and not r.manual_steps:
            r.end_step()

    r.handles.append(optimizer.register_step_post_hook(post))
    if _records_reduced(r):
        r.handles.append(
            optimizer.register_step_pre_hook(
                lambda opt, args, kwargs: None if nested_step() else record_reduced(r)
            )
        )
    r.handles.append(
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: None if nested_step() else applied_norm(r))
    )


def attach_scaler(r: Recording, scaler: torch.amp.GradScaler) -> None:
    """Wrap ``scaler.scale`` (the loss and the loss scale it multiplies by), ``scaler.update`` (scale, found-inf,
    growth tracker and the step boundary) and, in a distributed run, ``scaler.unscale_`` (the reduced
    gradients, still scaled).

    The scale is taken when the loss is scaled, so a step that stops after backward and before
    ``scaler.update()`` (an exception, Ctrl-C, an out-of-memory error in the optimizer) keeps the true loss
    scale on its gradient rows and in ``steps.scale``, and its ``grad_norm`` is unscaled like any other's."""
    if _records_reduced(r):
        orig_unscale = scaler.unscale_

        def unscale_(optimizer: torch.optim.Optimizer) -> None:
            record_reduced(r)  # before unscaling: the rows carry the loss scale like the local ones
            orig_unscale(optimizer)

        r.patch(scaler, "unscale_", unscale_)
    orig_scale = scaler.scale

    def scale(outputs: Any) -> Any:
        result = orig_scale(outputs)
        rec = r.rec
        if rec.active and (r.loss_filter is None or r.loss_filter(outputs)):
            r.record_loss(outputs)
            if rec.pending.scale is None and scaler.is_enabled():
                # the scale this step's backward multiplies by (a copy; it changes only in update()): a step
                # interrupted before update() keeps it on its gradient rows, in steps.scale and grad_norm
                rec.pending.scale = scaler_tensor(scaler, "_scale")
        return result

    r.patch(scaler, "scale", scale)
    r.patch(scaler, "update", _wrap_update(r, scaler, scaler.update))


def _found_inf(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    found = [
        v
        for st in getattr(scaler, "_per_optimizer_states", {}).values()
        for v in st.get("found_inf_per_device", {}).values()
    ]
    return torch.stack([f.to(found[0].device).float().sum() for f in found]).sum() if found else None


def _wrap_update(r: Recording, scaler: torch.amp.GradScaler, orig: Callable[..., Any]) -> Callable[..., Any]:
    def update(new_scale: Any = None) -> None:
        rec = r.rec
        if rec.active and scaler.is_enabled():
            rec.pending.scale = scaler_tensor(scaler, "_scale")
            rec.pending.found_inf = _found_inf(scaler)
        orig(new_scale)
        if rec.active:
            if scaler.is_enabled():
                rec.pending.next_scale = scaler_tensor(scaler, "_scale")
                rec.pending.growth_tracker = scaler_tensor(scaler, "_growth_tracker")
            r.end_step()

    return update
