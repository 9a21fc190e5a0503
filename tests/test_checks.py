"""The suite's own guards (conftest.py's rules 4 and 5, the required pytest-timeout,
checks.communicate_bounded and run_bounded): each one must catch what it is there for, so each
is run here on a test or a child made to break it."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from checks import alive, communicate_bounded, run_bounded

HERE = os.path.dirname(os.path.abspath(__file__))


def _inner_pytest(tmp_path, test_source, default_timeout_s=None, args=()):
    """Runs pytest in a child on one test file under tests/conftest.py (its DEFAULT_TIMEOUT_S
    replaced where given), with extra pytest `args`; returns (returncode, output, seconds)."""
    with open(os.path.join(HERE, "conftest.py")) as f:
        conftest = f.read()
    if default_timeout_s is not None:
        assert "\nDEFAULT_TIMEOUT_S = " in conftest
        conftest = conftest.replace("\nDEFAULT_TIMEOUT_S = ",
                                    f"\nDEFAULT_TIMEOUT_S = {default_timeout_s}  # ", 1)
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "checks.py").write_text(open(os.path.join(HERE, "checks.py")).read())
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(test_source))
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             *args, str(tmp_path / "test_inner.py")], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out = communicate_bounded(proc, 120)
    return proc.returncode, out, time.monotonic() - start


@pytest.mark.timeout(180)
def test_a_test_without_its_own_timeout_gets_the_default(tmp_path):
    """conftest gives every unmarked test DEFAULT_TIMEOUT_S: with the default made 2 s, a test
    that sleeps 100 s fails on the timeout long before it would end."""
    rc, out, took = _inner_pytest(tmp_path, """
        import time

        def test_sleeps():
            time.sleep(100)
    """, default_timeout_s=2)
    assert rc != 0 and "Timeout" in out, out
    assert took < 90, (took, out)


@pytest.mark.timeout(180)
def test_without_pytest_timeout_the_session_fails(tmp_path):
    """pytest-timeout is required: disabled (as if not installed), the session stops before any
    test runs, with a message that says what to install; a passing test would pass otherwise."""
    rc, out, _ = _inner_pytest(tmp_path, """
        def test_passes():
            pass
    """, args=("-p", "no:timeout"))
    assert rc != 0, out
    assert "pytest-timeout is required" in out and "pip install pytest-timeout" in out, out
    assert "passed" not in out, out


@pytest.mark.timeout(180)
def test_a_leaked_environment_variable_fails_the_test(tmp_path):
    """The autouse environment_restored fixture fails a test that leaves os.environ changed,
    names the variable, and restores it."""
    rc, out, _ = _inner_pytest(tmp_path, """
        import os

        def test_leaks():
            os.environ["RINGREDUCE_TEST_LEAK"] = "1"

        def test_after():
            assert "RINGREDUCE_TEST_LEAK" not in os.environ

        def test_clean(monkeypatch):
            monkeypatch.setenv("RINGREDUCE_TEST_CLEAN", "1")
    """)
    assert rc != 0, out
    assert "left os.environ changed: ['RINGREDUCE_TEST_LEAK']" in out, out
    assert "3 passed, 1 error" in out and "ERROR at teardown of test_leaks" in out, out


@pytest.mark.timeout(60)
def test_communicate_bounded_kills_the_whole_process_group():
    """A child that never ends, with a grandchild holding its pipe: communicate_bounded returns
    near its bound with what was printed and the kill noted, and nothing of the group lives on."""
    proc = subprocess.Popen(["bash", "-c", "sleep 300 & echo started; wait"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    start = time.monotonic()
    out = communicate_bounded(proc, 2)
    took = time.monotonic() - start
    assert "started" in out and "(killed after 2 s)" in out, out
    assert took < 15, took
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail("a process of the group outlived communicate_bounded")


@pytest.mark.timeout(60)
def test_run_bounded_kills_a_timed_out_launchers_workers(tmp_path):
    """A launcher (like torchrun) whose worker never ends: past the bound run_bounded returns
    with the kill noted, and the worker is gone too (subprocess.run(timeout=...) kills only the
    launcher, and the worker would run on into later tests)."""
    pid_file = tmp_path / "worker.pid"
    launcher = ("import subprocess, sys\n"
                "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
                f"open({str(pid_file)!r}, 'w').write(str(w.pid))\n"
                "w.wait()\n")
    start = time.monotonic()
    code, out = run_bounded([sys.executable, "-c", launcher], 5)
    assert time.monotonic() - start < 20, out
    assert code != 0 and "(killed after 5 s)" in out, (code, out)
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(worker):
        os.kill(worker, signal.SIGKILL)
        pytest.fail("the launcher's worker outlived run_bounded's timeout")
