"""Rules of this suite (keep new tests to them).

1. A check must be able to fail. Make every new check fail once on a planted bug before you
   trust it. No check that compares a value with itself or with something that differs anyway.
2. References are independent: float64 or exact integers computed in the test (reference.py),
   never by calling the code under test (e.g. ringreduce.hierarchy.fold).
3. Random inputs come from fixed seeds that are printed (checks.seeded); never hash() of a str,
   which Python randomises per process.
4. Leave the process as you found it: environment changes through monkeypatch (the
   `environment_restored` fixture below fails a test that leaks one); /dev/shm checked per
   test's own segments (checks.segments_of with the ranks' pids), never every segment on the
   machine; threads counted from /proc/self/task (checks.thread_count), which sees C++ threads.
5. Every wait is bounded: each test gets DEFAULT_TIMEOUT_S through pytest-timeout (required:
   the session refuses to start without it) unless it has its own @pytest.mark.timeout;
   subprocesses run with a timeout, in their own session when they start children, and are
   killed by process group (checks.communicate_bounded, checks.run_bounded for launchers).
6. GPU tests use checks.needs_cuda (skip with the reason, fail under
   RINGREDUCE_REQUIRE_CUDA=1), never a home-made skipif. Whatever can run on CPU runs on CPU.
7. Assert ringreduce's behaviour, not one torch release's: where torch's own exception type or
   dtype support differs between releases, accept each release's form or probe it.
8. Shared helpers live in checks.py (and reference.py for references); no copies per module.
"""
import os
import sys

import pytest

# tests import the shared references as plain modules
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The bound of a test without its own @pytest.mark.timeout (the longest, the two-launcher
# torchrun test, takes about 60 s on an idle 2-core machine).
DEFAULT_TIMEOUT_S = 900


def pytest_collection_modifyitems(config, items):
    # A bound given on the command line (`--timeout=120`, as scripts/gpu_check.sh gives) applies
    # to every test without a marker of its own: a marker would take precedence over it.
    if config.getoption("timeout", None):
        return
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TIMEOUT_S))


# Set for the whole process by pytest itself or by torch on first use (not by a test).
_SET_BY_PYTEST_OR_TORCH = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


@pytest.fixture(autouse=True)
def environment_restored():
    """Every test leaves os.environ as it found it (a variable set by the code under test leaks
    into later tests and their subprocesses otherwise): use monkeypatch.setenv/delenv."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    changed = sorted(k for k in before.keys() | after.keys()
                     if before.get(k) != after.get(k) and k not in _SET_BY_PYTEST_OR_TORCH)
    if changed:
        os.environ.clear()
        os.environ.update(before)
        pytest.fail(f"the test left os.environ changed: {changed}", pytrace=False)


def pytest_configure(config):
    # Rule 5: without pytest-timeout no test has a bound, and a hang would stall the run.
    if not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError(
            "tests/conftest.py: pytest-timeout is required (it bounds every test) but is not "
            "installed or was disabled (-p no:timeout); install it: pip install pytest-timeout "
            "(scripts/setup.sh does)")
    config.addinivalue_line("markers", "needs_cuda: a GPU test (checks.needs_cuda)")


@pytest.fixture(autouse=True)
def cuda_required(request):
    """For tests marked checks.needs_cuda (as a decorator, pytestmark or in a pytest.param):
    skips them with the reason where no GPU test can run, or fails them under
    RINGREDUCE_REQUIRE_CUDA=1."""
    if request.node.get_closest_marker("needs_cuda") is not None:
        from checks import require_cuda

        require_cuda()
