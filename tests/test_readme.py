"""What the README tells a new user first."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_first_example_leads_with_the_diagnosis() -> None:
    first = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert first is not None
    prints = [line.split("#")[0].strip() for line in first.group(1).splitlines() if line.startswith("print(")]
    assert prints == ["print(tr.diagnose())", "print(tr.first_overflow())"]
