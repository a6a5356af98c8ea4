"""The layers' packages load torch (about 2 s of CPU) only when a torch-backed name is used, so the ``ascend-emu``
commands that never compute with it (timing-only ``model`` ops, ``serve-model``) do not pay for it; every public
name still resolves to the object its module defines."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


def _run(code: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def test_the_command_modules_import_without_torch():
    out = _run("import sys; from ascend_emu import cli; cli.load_command_modules();"
               "import kernels, serving, quant; print('torch' in sys.modules, sorted(cli.COMMANDS) != [])")
    assert out == ["False", "True"]


@pytest.mark.parametrize("package, attribute", [("kernels", "rope"), ("serving", "EmulatedRunner"),
                                                ("quant", "quantize_model")])
def test_a_torch_backed_name_loads_torch_on_first_use(package, attribute):
    out = _run(f"import sys, {package}; before = 'torch' in sys.modules; getattr({package}, {attribute!r});"
               f"print(before, 'torch' in sys.modules)")
    assert out == ["False", "True"]


@pytest.mark.parametrize("package", ["serving", "quant"])
def test_every_public_name_is_its_modules_object(package):
    pkg = importlib.import_module(package)
    for name in pkg.__all__:
        value = getattr(pkg, name)
        module = pkg._EXPORTS.get(name)
        if module is not None:
            assert value is getattr(importlib.import_module(f"{package}.{module}"), name), name
        assert name in dir(pkg)
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(pkg, "no_such_name")


def test_quant_calibrate_stays_the_function_and_the_cli_schemes_are_the_models():
    import quant
    import quant.cli
    import quant.model            # imports the submodule quant.calibrate, which must not shadow the function
    calibrate_module = sys.modules["quant.calibrate"]
    assert quant.calibrate is calibrate_module.calibrate and callable(quant.calibrate)
    assert quant.cli.SCHEMES == quant.model.SCHEMES
    assert calibrate_module.NORM_TYPES == calibrate_module.norm_types()
