import numpy as np
import pytest

from ascend_emu import Pod, cloudmatrix384


@pytest.fixture
def pod():
    """A small pod: 2 dies of one chip plus dies on other servers up to 33 (remote paths)."""
    return Pod(cloudmatrix384(dies=34))


@pytest.fixture
def rng():
    return np.random.default_rng(0)
