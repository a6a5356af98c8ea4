"""The rule of the packages' robustness sweeps, over ``tests.emu.isolation``'s child process (a case that crashes
the interpreter or hangs fails its test with ``Crashed`` / ``Hung`` instead of taking down the run).

A case is a module-level function that checks its own result against the reference and returns nothing. ``check``
asserts the rule: with valid arguments the case passes; with an argument made invalid it raises one of the library's
own errors (an ``ascend_emu`` EmulatorError, or a ``quant`` QuantError) whose message names that argument.
"""
from __future__ import annotations

import pytest

from tests.emu.isolation import Child

QUANT_ERRORS = frozenset({"QuantError", "CalibrationError", "CholeskyError"})     # quant stands alone (DESIGN 2)
TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def child():
    """One worker process per test module."""
    c = Child(timeout_s=TIMEOUT_S)
    yield c
    c.close()


def check(child: Child, case, *args, names: tuple = ()):
    """Run ``case(*args)`` in ``child`` and assert the rule. ``names``: how an error may name the arguments the case
    made invalid (empty: every argument is valid, so the case must pass). Returns the outcome."""
    out = child.call(case, *args)
    if not names:
        assert out.error is None, f"valid arguments raised {out.error}: {out.message}\n{out.trace}"
        return out
    assert out.error is not None, f"accepted an invalid argument ({' / '.join(names)}) without an error"
    assert out.library or out.error in QUANT_ERRORS, f"{out.error} is not a library error: {out.message}\n{out.trace}"
    assert any(n in out.message for n in names), f"{out.error} names none of {names}: {out.message}"
    return out
