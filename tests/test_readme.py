"""The README's Python examples run as written (in a scratch directory: they write traces)."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_example(i, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(BLOCKS[i], f"README.md block {i}", "exec"), {"__name__": "__readme__"})


def test_readme_has_examples():
    assert len(BLOCKS) >= 2
