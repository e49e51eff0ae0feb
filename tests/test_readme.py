"""The README quick tour runs exactly as written (issue 20): its first ```python block is executed
in a fresh namespace on the embedded model, on CPU."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def first_python_block(text: str) -> str:
    m = re.search(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert m, "README.md has no ```python block"
    return m.group(1)


def test_readme_quick_tour_runs(capsys):
    code = first_python_block(README.read_text())
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    assert "Paris" in out and "hook_weights" in out and "bug moves logits by" in out
    assert out.count("layers.1.hook_resid_post") == 3  # layer-graph decode: the hook fires at prefill + 2 steps
