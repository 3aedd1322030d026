"""nantrace: find where and why fp16/bf16 PyTorch training goes NaN.

``with nantrace.trace(model, scaler=scaler, optimizer=opt) as tr:`` around the unchanged training loop records
the range and inf/NaN counts of every activation and gradient; ``tr.first_overflow()`` names the module, phase
and step that produced the first non-finite value.
"""

from ._compare import Comparison, compare
from ._diagnosis import Diagnosis
from ._errors import NantraceError
from ._hunt import Culprit, hunt
from ._overflow import Overflow
from ._repro import Repro, load_repro
from ._trace import Trace, load, trace, watch
from ._version import __version__ as __version__

__all__ = [
    "Comparison",
    "Culprit",
    "Diagnosis",
    "NantraceError",
    "Overflow",
    "Repro",
    "Trace",
    "compare",
    "hunt",
    "load",
    "load_repro",
    "trace",
    "watch",
]
