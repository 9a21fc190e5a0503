"""ringreduce's own threads leave a user's CUDA graph capture alone (csrc/ring/capture_mode.h),
on a fake of CUDA's rule for unsafe calls during capture (tests/fake_cuda/fake_capture.cpp): a
thread in the default (global) mode that queries an event while another thread captures in
global mode, torch.cuda.graph's default, invalidates that capture; in thread-local mode it does
not. Whether the backend's threads call it is checked on a GPU
(tests/test_distributed_cuda.py::test_capture_beside_collectives_in_flight)."""
import os
import subprocess
import sys

import pytest

from fake_cuda.build import CXX, FAKE, build

pytestmark = pytest.mark.skipif(CXX is None or not sys.platform.startswith("linux"),
                                reason="needs a C++ compiler on Linux")

SUCCESS, CAPTURE_UNSUPPORTED = 0, 900
ACTIVE, INVALIDATED = 1, 2


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return build(tmp_path_factory.mktemp("fake_capture"), "capture_mode_driver", [
        os.path.join(FAKE, "fake_capture.cpp"),
        os.path.join(FAKE, "capture_mode_driver.cpp")])


def run(driver, mode):
    proc = subprocess.run([driver, mode], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    query, capture = proc.stdout.split()[1::2]
    return int(query), int(capture)


def test_the_fake_invalidates_a_global_capture_on_a_default_query(driver):
    assert run(driver, "default") == (CAPTURE_UNSUPPORTED, INVALIDATED)


def test_our_threads_query_without_invalidating_the_capture(driver):
    assert run(driver, "ours") == (SUCCESS, ACTIVE)

