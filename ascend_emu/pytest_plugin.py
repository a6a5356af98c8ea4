"""pytest plugin: ``pytest --ascend-sanitize`` runs a test suite with the race sanitizer on every ``Pod`` it makes.

Pods made without a ``sanitize=`` of their own then raise ``RaceError`` at the end of a launch that raced
(``--ascend-sanitize=collect``: they keep going and list the races in ``run.races``, and each test that made a racing
pod fails at teardown with the list). ``--ascend-jitter-seed N`` (with ``--ascend-jitter F``, default 0.3) also
perturbs their latencies with seed ``N`` (``ascend_emu.jitter``).

Registered through the ``pytest11`` entry point (installed) and ``-p ascend_emu.pytest_plugin`` (this project's
pytest options, for a source tree on PYTHONPATH); a suite elsewhere adds ``-p ascend_emu.pytest_plugin``.
"""
from __future__ import annotations

import pytest


def pytest_addoption(parser) -> None:
    group = parser.getgroup("ascend-emu")
    group.addoption("--ascend-sanitize", nargs="?", const="raise", default=None, choices=("raise", "collect"),
                    help="race-check every Pod the tests make: raise RaceError at the end of a launch that raced "
                         "(default), or collect the races and fail the test at teardown")
    group.addoption("--ascend-jitter-seed", type=int, default=None, metavar="N",
                    help="perturb every Pod's latencies with this seed (ascend_emu.jitter)")
    group.addoption("--ascend-jitter", type=float, default=0.3, metavar="F",
                    help="the largest perturbation, a fraction of each latency (default 0.3)")


@pytest.fixture(autouse=True)
def _ascend_sanitize(request):
    """Each test's pods sanitize (and jitter) as the options say; in collect mode the races they found fail it."""
    config = request.config
    mode = config.getoption("--ascend-sanitize")
    seed = config.getoption("--ascend-jitter-seed")
    if mode is None and seed is None:
        yield
        return
    from .pod import pod_defaults
    sanitize = {None: False, "raise": True, "collect": "collect"}[mode]
    with pod_defaults(sanitize=sanitize, jitter_seed=seed, jitter=config.getoption("--ascend-jitter")) as found:
        yield
    races = [r for s in found for r in s.races]
    if mode == "collect" and races:
        pytest.fail(f"{len(races)} race(s) under --ascend-sanitize:\n  " + "\n  ".join(str(r) for r in races[:10]),
                    pytrace=False)
