import pytest

from tests.fixtures_s3 import *  # noqa
from tests.fixtures_targets import *  # noqa


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny models on a 2-core machine: a second thread only spins (up to 40x slower under load).
    Stages run as subprocesses keep torch's own default."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
