"""The install owns its top-level packages: no other installed distribution ships a package of the same name,
which would shadow ours wherever the installed copy is found first (the ``ascend-emu`` command runs from the
scripts folder, so site-packages comes before an editable install)."""
from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGES = ("ascend_emu", "xccl", "kernels", "quant", "eplb", "serving")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_other_installed_distribution_ships_the_package(package):
    owners = set(importlib.metadata.packages_distributions().get(package, [])) - {"ascend-emu", "ascend_emu"}
    assert not owners, (f"installed distribution(s) {sorted(owners)} also ship a top-level '{package}' package; "
                        f"it shadows ours (see the transformers pin in pyproject.toml)")


@pytest.mark.parametrize("package", PACKAGES)
def test_the_package_resolves_to_this_source_tree_from_outside_it(package, tmp_path):
    path = subprocess.run([sys.executable, "-c", f"import {package}; print({package}.__file__)"], cwd=tmp_path,
                          capture_output=True, text=True, check=True).stdout.strip()
    assert Path(path).resolve().is_relative_to(ROOT), path
