import os
import sys

import pytest

# tests import the shared references as plain modules
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cuda_required():
    """For tests marked checks.needs_cuda: skips them with the reason where no GPU test can run,
    or fails them under RINGREDUCE_REQUIRE_CUDA=1."""
    from checks import require_cuda

    require_cuda()
