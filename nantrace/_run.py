"""``nantrace run``: trace an unmodified training script, in the spirit of ``python -m cProfile``.

How the script is found and traced, without changing it:

* The script runs as ``python script.py args`` would run it: compiled and executed in a fresh ``__main__`` module
  (``__name__ == "__main__"``, ``__file__`` its absolute path), with ``sys.argv = [script, *args]`` (``argv[0]``
  as typed) and ``sys.path[0]`` = the script's directory (all restored afterwards).
* Global module hooks (``torch.nn.modules.module.register_module_forward_pre_hook`` / ``..._forward_hook``)
  watch every module call. A *root* is a module that has parameters and is called while no other module is
  running (outside backward). Each root gets its own :class:`~nantrace.Trace`, created and entered at its first
  call; parameter-free modules called at the top level (loss modules such as ``nn.CrossEntropyLoss``) are not
  roots. A top-level call of a module already inside a traced root is recorded by that root's trace.
* Each root is named after the variable that holds it in the calling frames (``model``, ``G``, ``netD``), else
  after its class in lower case; a repeated name gets ``-2``, ``-3``.
* Optimizers: ``torch.optim.Optimizer.__init__`` is wrapped while the script runs (restored afterwards), so an
  optimizer is known when it is created and bound to every root whose parameters it updates (at the root's first
  call, or at its creation if that comes later); the first one created wins when several update a root. Its
  steps are seen through the trace's step post-hook; the global step pre-hook
  (``torch.optim.optimizer.register_optimizer_step_pre_hook``) catches an optimizer whose ``__init__`` was not
  seen.
* Losses: with a GradScaler, the loss is what ``scaler.scale`` gets. Without one, ``torch.Tensor.backward`` is
  wrapped while the script runs (restored afterwards): the tensor ``backward()`` is called on is the loss of the
  roots its autograd graph reaches.
* GradScalers: while the script runs, ``torch.amp.GradScaler.__init__`` is wrapped (``torch.cuda.amp.GradScaler``
  derives from it) so each scaler the script creates is known; it is restored exactly afterwards. A root is bound
  to the latest scaler created before its first call, or to the first one created after it. When one scaler
  serves several roots (the GAN recipe of the PyTorch AMP docs), a loss passed to ``scaler.scale`` is recorded
  by the roots whose parameters its autograd graph reaches.

Output: when the script ends (normally, by an exception, ``sys.exit`` or Ctrl-C) every trace is closed and saved,
atomically, to ``OUT/trace.nantrace`` (the first root) and ``OUT/trace.<name>.nantrace`` (each further root);
the report and diagnosis go to **stderr**, so the script's stdout is unchanged. The exit code is the script's:
0 at a normal end, ``n`` for ``sys.exit(n)``, 1 for an uncaught exception (its traceback is printed as Python
prints it), 130 for Ctrl-C. Under ``torchrun -m nantrace run`` each rank saves its part (``Trace.save`` makes
``OUT/trace.nantrace`` a folder of rank parts when ``world_size > 1``).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import importlib.machinery
import inspect
import io
import os
import runpy
import signal
import sys
import traceback
import types
import warnings
import weakref
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import torch
from torch import nn
from torch.nn.modules import module as _module
from torch.optim import optimizer as _optimizer
from torch.utils.hooks import RemovableHandle

from ._errors import NantraceError
from ._hooks import in_backward
from ._options import TraceOptions
from ._procgroup import PART_RE
from ._recording import Recording, tracing
from ._report import print_report
from ._trace import Trace, trace_of
from ._tree import flatten
from ._watch import Watch

__all__ = ["EXIT_INTERRUPTED", "RunResult", "run_script", "trace_file_name"]

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd program
EXIT_TERMINATED = 143  # 128 + SIGTERM: how SLURM, Kubernetes and torchrun stop a job


class _Terminated(BaseException):
    """Raised in the script by SIGTERM, so the traces are saved and reported before ``nantrace run`` exits."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated(f"stopped by signal {signum} (SIGTERM)")


@contextlib.contextmanager
def _sigterm_saves() -> Iterator[None]:
    """While the script runs, SIGTERM raises :class:`_Terminated` in it (main thread only; elsewhere no-op)."""
    try:
        old = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


_PKG_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
_SNAPSHOT_LOCALS = sys.version_info < (3, 13)  # frame.f_locals is a cached dict snapshot (PEP 667 changed it)


def trace_file_name(index: int, name: str) -> str:
    """``trace.nantrace`` for the first root (``index`` 0), ``trace.<name>.nantrace`` for the others."""
    return "trace.nantrace" if index == 0 else f"trace.{name}.nantrace"


@dataclasses.dataclass
class RunResult:
    """What :func:`run_script` did.

    Attributes:
        exit_code: the script's exit code (0, ``n`` of ``sys.exit(n)``, 1 after an exception, 130 after Ctrl-C).
        traces: root name → its closed :class:`~nantrace.Trace`, in the order the roots were first called.
        paths: root name → the file its trace was saved to (missing for a trace that could not be saved).
        classes: root name → the root's class name.
        notes: things the user should know (a root left untraced, a save that failed), one sentence each.
    """

    exit_code: int
    traces: dict[str, Trace]
    paths: dict[str, Path]
    classes: dict[str, str]
    notes: list[str]


def _reachable_params(loss: Any) -> set[int]:
    """ids of the leaf tensors (parameters) the autograd graph of ``loss`` reaches; pure Python, no device read."""
    seen: set[int] = set()
    out: set[int] = set()
    todo = [t.grad_fn for _, t in flatten(loss, "loss") if t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)
        if isinstance(var, torch.Tensor):
            out.add(id(var))
        todo.extend(f for f, _ in fn.next_functions if f is not None)
    return out


class _Session:
    """The global hooks and class patches of one ``nantrace run``; ``with`` installs and removes them."""

    def __init__(self, trace_options: TraceOptions, watch: int | bool | None = False) -> None:
        self.options = trace_options
        self.watch = watch  # False: trace every step; else nantrace.watch with this `every`
        self.watches: dict[int, Watch] = {}  # id(recording) -> its Watch
        self.traces: list[tuple[str, Recording]] = []
        self.facades: dict[str, Trace] = {}
        self.classes: dict[str, str] = {}
        self.notes: list[str] = []
        self.depth = 0
        self.handled: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # roots traced or turned down
        self.optimizers: list[weakref.ref[torch.optim.Optimizer]] = []  # in creation order
        self.known_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.scalers: list[weakref.ref[torch.amp.GradScaler]] = []
        self.handles: list[RemovableHandle] = []
        self.patched: list[tuple[type, str, Any]] = []
        self.broken = False
        self._loss_cache: tuple[weakref.ref[Any] | None, set[int]] = (None, set())

    # ------------------------------------------------------------------ install / remove
    def __enter__(self) -> _Session:
        try:
            self.handles.append(_module.register_module_forward_pre_hook(self._pre))
            self.handles.append(_module.register_module_forward_hook(self._post, always_call=True))
            self.handles.append(_optimizer.register_optimizer_step_pre_hook(self._optimizer_pre))
            self._patch_classes()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Exit every trace (newest first, so patches on a shared scaler unwind in order), then remove the
        global hooks and restore the patched class attributes."""
        try:
            for _, tr in reversed(self.traces):
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # "recorded nothing" cannot happen for a called root
                        w = self.watches.get(id(tr))
                        w.exit(failed=False) if w is not None else tr.exit(failed=False)
                except Exception as e:  # pragma: no cover - a trace that cannot close still gets reported
                    self.notes.append(f"closing a trace failed: {type(e).__name__}: {e}")
        finally:
            self._remove()

    def _remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for cls, attr, orig in reversed(self.patched):
            setattr(cls, attr, orig)
        self.patched.clear()

    def _wrap(self, cls: type, attr: str, after: Callable[[Any], None] | None, before: Any = None) -> None:
        """Replace ``cls.attr`` (a function in the class's own ``__dict__``) by a wrapper that calls ``before``
        or ``after`` (guarded) with the instance; :meth:`_remove` puts the original object back."""
        orig = cls.__dict__[attr]
        session = self

        def wrapper(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if before is not None:
                session._guard(before, obj)
            result = orig(obj, *args, **kwargs)
            if after is not None:
                session._guard(after, obj)
            return result

        wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        for a in ("__name__", "__qualname__", "__doc__", "__module__"):
            setattr(wrapper, a, getattr(orig, a, None))
        self.patched.append((cls, attr, orig))
        setattr(cls, attr, wrapper)

    def _patch_classes(self) -> None:
        """``GradScaler.__init__`` and ``Optimizer.__init__``: know each scaler/optimizer the script creates
        (subclasses, ``torch.cuda.amp.GradScaler`` included, run the base ``__init__``). ``Tensor.backward``: a
        loop without a GradScaler still has its loss recorded (:meth:`_on_backward`)."""
        self._wrap(torch.amp.GradScaler, "__init__", after=self._on_scaler)
        self._wrap(torch.optim.Optimizer, "__init__", after=self._on_optimizer)
        self._wrap(torch.Tensor, "backward", after=None, before=self._on_backward)

    def _on_backward(self, loss: torch.Tensor) -> None:
        takers = [t for _, t in self.traces if t.scaler is None and (t.active or id(t) in self.watches)]
        if not takers or loss.grad_fn is None or not loss.is_floating_point():
            return
        if len(self.traces) > 1:
            reached = _reachable_params(loss)
            takers = [t for t in takers if any(id(p) in reached for p in t.root.parameters())]
        for t in takers:
            w = self.watches.get(id(t))
            w.record_loss(loss) if w is not None else t.record_loss(loss)

    # ------------------------------------------------------------------ guarded entry points
    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn``; a failure inside nantrace never breaks the script: it is noted and tracing stops."""
        if self.broken:
            return
        try:
            fn(*args)
        except Exception as e:
            self.broken = True
            self.notes.append(
                f"nantrace stopped following the script after an internal error: {type(e).__name__}: {e}"
            )

    def _pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self.depth == 0 and module not in self.handled and not in_backward():
            if tracing(module) is None:
                self._guard(self._maybe_root, module, args, _caller_kwargs())
            elif all(tracing(module) is not tr for _, tr in self.traces):
                self._guard(self._self_traced, module)
        self.depth += 1

    def _self_traced(self, module: nn.Module) -> None:
        """A top-level module call traced by a ``nantrace.trace()`` of the script itself: noted once, and the
        module is never traced by this run (two traces cannot hook one model)."""
        self.handled.add(module)
        self.notes.append(
            f"`{self._name(module)}` ({type(module).__name__}) was not traced: the script traces its own model "
            "with nantrace.trace(), which `nantrace run` does not support. Run the script with plain `python` and "
            "save its trace there with Trace.save, or remove its nantrace.trace() call."
        )

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth = max(0, self.depth - 1)

    def _on_scaler(self, scaler: torch.amp.GradScaler) -> None:
        self.scalers.append(weakref.ref(scaler))
        self._bind_late_scaler(scaler)

    def _on_optimizer(self, opt: torch.optim.Optimizer) -> None:
        if opt not in self.known_optimizers:
            self.known_optimizers.add(opt)
            self.optimizers.append(weakref.ref(opt))
        self._bind_optimizer(opt)

    def _optimizer_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if opt not in self.known_optimizers:  # one whose __init__ nantrace did not see
            self._guard(self._on_optimizer, opt)

    # ------------------------------------------------------------------ roots
    def _maybe_root(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if module in self.handled or tracing(module) is not None:
            return
        if next(module.parameters(), None) is None:
            self.handled.add(module)  # a loss or activation module, not a model
            return
        name = self._name(module)
        if any(tracing(m) is not None for m in module.modules()):
            self.handled.add(module)
            self.notes.append(
                f"`{name}` ({type(module).__name__}) was not traced: it contains a model that is already traced"
            )
            return
        try:
            tr = Recording(module, scaler=None, optimizer=None, options=self.options)
        except ValueError as e:  # modules= matched nothing in this root
            self.handled.add(module)
            self.notes.append(f"`{name}` ({type(module).__name__}) was not traced: {e}")
            return
        scaler = self._latest_scaler()
        watch = None if self.watch is False else Watch(tr, self.watch)
        if watch is not None:
            self.watches[id(tr)] = watch
            watch.enter()
        else:
            tr.enter()
        self.handled.add(module)  # a wrapper root (DDP) is not hooked itself: the model it wraps is
        tr.options["name"] = name
        self.traces.append((name, tr))
        self.facades[name] = trace_of(tr, watch)
        self.classes[name] = type(module).__name__
        for ref in self.optimizers:
            opt = ref()
            if opt is not None:
                self._bind_optimizer(opt)
        if scaler is not None:
            self._bind_scaler(tr, scaler)
        # Hooks registered inside a module call do not run for that call: run the root's pre-hooks ourselves
        # (the sentinel's too: with --watch and no periodic full step, step 0 is watched from its first call).
        (watch or tr).run_pre_hook(module, args, kwargs)

    def _name(self, module: nn.Module) -> str:
        base = type(module).__name__.lower()
        frame = sys._getframe(2)
        while frame is not None:
            if not frame.f_code.co_filename.startswith(_PKG_DIRS):
                found = [k for k, v in _locals_of(frame).items() if v is module and k != "self"]
                if found:
                    base = found[0]
                    break
            frame = frame.f_back  # type: ignore[assignment]
        taken = {n for n, _ in self.traces}
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}-{n}"
        return name

    # ------------------------------------------------------------------ optimizers and scalers
    def _bind_optimizer(self, opt: torch.optim.Optimizer) -> None:
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        for _, tr in self.traces:
            if tr.optimizer is None and not tr.closed and any(id(p) in ids for p in tr.root.parameters()):
                w = self.watches.get(id(tr))
                w.bind(optimizer=opt) if w is not None else tr.bind(optimizer=opt)

    def _latest_scaler(self) -> torch.amp.GradScaler | None:
        for ref in reversed(self.scalers):
            s = ref()
            if s is not None:
                return s
        return None

    def _bind_late_scaler(self, scaler: torch.amp.GradScaler) -> None:
        for _, tr in self.traces:
            if tr.scaler is None and not tr.closed:
                self._bind_scaler(tr, scaler)

    def _bind_scaler(self, tr: Recording, scaler: torch.amp.GradScaler) -> None:
        w = self.watches.get(id(tr))
        w.bind(scaler=scaler) if w is not None else tr.bind(scaler=scaler)
        sharing = [t for _, t in self.traces if t.scaler is scaler]
        if len(sharing) > 1:
            for t in sharing:
                t.loss_filter = self._loss_filter_for(t)

    def _loss_filter_for(self, tr: Recording) -> Callable[[Any], bool]:
        root = tr.root

        def accepts(loss: Any) -> bool:
            ref, reached = self._loss_cache
            if ref is None or ref() is not loss:
                reached = _reachable_params(loss)
                with contextlib.suppress(TypeError):  # a container of tensors cannot be weakly referenced
                    self._loss_cache = (weakref.ref(loss), reached)
            return any(id(p) in reached for p in root.parameters())

        return accepts


def _locals_of(frame: FrameType) -> dict[str, Any]:
    """A copy of ``frame``'s local variables that leaves no reference behind.

    Before Python 3.13, reading ``f_locals`` of a function frame fills a dict cached on the frame, which would
    keep every local of that moment (a batch, say) alive until the frame ends; that cache is emptied after the
    copy (the interpreter refills it whenever it is read again). From 3.13 ``f_locals`` is a view (PEP 667)."""
    loc = frame.f_locals
    out = dict(loc)
    if _SNAPSHOT_LOCALS and frame.f_code.co_flags & inspect.CO_OPTIMIZED:
        loc.clear()
    return out


def _caller_kwargs() -> dict[str, Any]:
    """The keyword arguments of the module call that runs the global pre-hook.

    PyTorch calls global forward pre-hooks with ``(module, args)`` only; the kwargs are a local of the
    ``Module._call_impl`` machinery two frames up. Only the root's first call needs them (later calls reach
    the trace's own ``with_kwargs`` pre-hook); if they cannot be found, that one call's keyword inputs go
    unrecorded."""
    frame = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            break
        if frame.f_code.co_filename == _module.__file__:
            kw = _locals_of(frame).get("kwargs")
            if isinstance(kw, dict):
                return kw
        frame = frame.f_back  # type: ignore[assignment]
    return {}


def _print_exception(e: BaseException, script: str) -> None:
    """Print ``e`` as Python prints an uncaught exception, without the frames of nantrace and runpy."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb if tb is not None else e.__traceback__, file=sys.stderr)


def _run_main(full: str) -> None:
    """Run the script at the absolute path ``full`` as python runs ``python script``: compiled from its bytes
    (PEP 263 encoding line honoured) and executed in a fresh ``__main__`` module that replaces
    ``sys.modules["__main__"]`` meanwhile, with ``__file__`` = ``full``. A zip archive goes through
    :func:`runpy.run_path` (it finds the ``__main__.py`` inside)."""
    if zipfile.is_zipfile(full):
        argv0 = sys.argv[0]
        runpy.run_path(full, run_name="__main__")  # sets sys.argv[0] = full while it runs
        sys.argv[0] = argv0
        return
    with io.open_code(full) as f:
        code = compile(f.read(), full, "exec")
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=full,
        __cached__=None,
        __package__=None,
        __spec__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", full),
        __builtins__=builtins,
    )
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _exec(script: str, args: Sequence[str]) -> int:
    saved_argv, saved_path = sys.argv, list(sys.path)
    full = os.path.abspath(script)  # Python runs a script under its absolute path (its __file__)
    sys.argv = [script, *args]  # argv[0] as typed, as python leaves it (runpy would make it absolute)
    sys.path[0] = os.path.dirname(full)
    try:
        _run_main(full)
        return 0
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
        return 1
    except KeyboardInterrupt as e:
        _print_exception(e, full)
        return EXIT_INTERRUPTED
    except _Terminated as e:
        print(f"nantrace run: {e}; saving the traces", file=sys.stderr)
        return EXIT_TERMINATED
    except BaseException as e:
        _print_exception(e, full)
        return 1
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        with contextlib.suppress(Exception):
            sys.stdout.flush()


def run_script(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    out: str | os.PathLike[str],
    options: TraceOptions | None = None,
    watch: int | bool | None = False,
    **trace_options: Any,
) -> RunResult:
    """Run ``script`` with ``args`` as ``python script args`` would, tracing every root model it calls, and save
    one trace per root in ``out`` (see the module docstring for roots, names and files).

    The trace options (``options``, or the keyword options of :func:`nantrace.trace` such as ``modules=``,
    ``phases=``, ``every=``) apply to every root. A root that a ``modules`` filter matches nothing of is left
    untraced, with a note.

    Args:
        script: path of the Python script.
        args: its command-line arguments (``sys.argv[1:]`` inside the script).
        out: an existing, writable directory for the trace files.
        watch: ``False`` (default) traces every step in full; an int N (or ``None``) watches every root as
            :func:`nantrace.watch` does with ``every=N`` (``None``: only the steps that go non-finite).

    Returns:
        a :class:`RunResult`; the exit code is the script's. Nothing the script raises escapes (its traceback is
        printed to stderr).

    Raises:
        FileNotFoundError: ``script`` is not a file.
        NantraceError: ``out`` is not an existing writable directory.
        ValueError, TypeError: a trace option is invalid (checked before the script starts).
    """
    path = os.fspath(script)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"script {path!r} is not a file")
    out_dir = Path(os.path.abspath(out))  # the script may chdir
    if not out_dir.is_dir() or not os.access(out_dir, os.W_OK):
        raise NantraceError(f"out {str(out_dir)!r} is not an existing writable directory; create it first")
    opts = options if options is not None else TraceOptions(**trace_options)  # checked before the script runs
    with _sigterm_saves(), _Session(opts, watch) as session:
        code = _exec(path, args)
    paths: dict[str, Path] = {}
    for i, (name, _) in enumerate(session.traces):
        try:
            paths[name] = session.facades[name].save(out_dir / trace_file_name(i, name))
        except (OSError, ValueError) as e:
            session.notes.append(f"saving the trace of `{name}` failed: {e}")
    return RunResult(code, dict(session.facades), paths, dict(session.classes), session.notes)


def print_run_report(result: RunResult, file: TextIO) -> None:
    """The report and diagnosis of every traced root, to ``file`` (the CLI uses stderr)."""
    print(file=file)
    if not result.traces:
        why = "." if result.notes else ": the script called no nn.Module with parameters."
        print(f"nantrace run: no model was traced{why}", file=file)
    else:
        names = ", ".join(f"`{n}` ({result.classes[n]})" for n in result.traces)
        print(f"nantrace run: traced {len(result.traces)} model(s): {names}", file=file)
    for name, tr in result.traces.items():
        print(f"\n=== model `{name}` ({result.classes[name]}) ===", file=file)
        print_report(tr, result.paths.get(name), file=file)
    for note in result.notes:
        print(f"nantrace run: {note}", file=file)
    if result.paths:
        first = next(iter(result.paths.values()))
        if PART_RE.match(first.name):  # under torchrun: the folder all ranks saved into, merged by load
            first = first.parent
        print(f"\nread it back with: nantrace report {first}", file=file)
