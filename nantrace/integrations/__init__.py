"""Callbacks that trace a training framework's run with nantrace.

* :mod:`nantrace.integrations.transformers`: ``NanTraceCallback`` for ``transformers.Trainer``
  (``pip install "nantrace[transformers]"``).
* :mod:`nantrace.integrations.lightning`: ``NanTraceCallback`` for ``lightning.pytorch.Trainer``
  (``pip install "nantrace[lightning]"``).

Importing this package imports neither framework; only the submodule you import does.
"""

__all__: list[str] = []
