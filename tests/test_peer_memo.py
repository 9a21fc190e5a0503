"""csrc/bindings.cpp's CUDA branch without a GPU.

- rr::PeerAccessMemo (csrc/ring/peer_memo.h), compiled by the host compiler against a stand-in
  for torch's get_p2p_access that behaves as torch's does: the first call for a pair records
  "allowed" and then throws while enabling, later calls return the recorded "allowed". The
  memo must keep the pair staged after the failure.
- The CUDA branch of execute() releases the GIL, like the CPU branch (a source check: that
  branch cannot run here; scripts/ci_cuda_build.sh builds it).
"""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"

DRIVER = r"""
#include <cstdio>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include "ring/peer_memo.h"

// torch's get_p2p_access: caches "allowed" for the pair, then enabling raises (once).
std::set<std::pair<int, int>> cached;
int calls = 0;
bool torch_get_p2p_access(int d, int p) {
  ++calls;
  if (cached.count({d, p})) return true;
  cached.insert({d, p});
  if (d == 1 && p == 0) throw std::runtime_error("cudaDeviceEnablePeerAccess: peer mapping failed\nbacktrace");
  return true;
}

int main() {
  rr::PeerAccessMemo memo;
  for (int round = 0; round < 3; ++round) {
    for (auto [d, p] : {std::pair{0, 1}, std::pair{1, 0}}) {
      std::string why;
      const bool ok = memo.get(d, p, torch_get_p2p_access, &why);
      std::printf("%d %d %d %d %s\n", round, d, p, int(ok), why.c_str());
    }
  }
  std::printf("calls %d\n", calls);
}
"""


@pytest.fixture(scope="module")
def memo_run(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("needs a host C++ compiler (c++ or g++)")
    d = tmp_path_factory.mktemp("peer_memo")
    (d / "driver.cpp").write_text(DRIVER)
    exe = d / "driver"
    build = subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", "-I", str(CSRC),
                            str(d / "driver.cpp"), "-o", str(exe), "-pthread"],
                           capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()


def test_failed_pair_stays_staged(memo_run):
    rows = [line.split(" ", 4) for line in memo_run if not line.startswith("calls")]
    for round_, d, p, ok, *why in rows:
        if (d, p) == ("1", "0"):
            assert ok == "0", f"round {round_}: pair 1<-0 read without peer access: {memo_run}"
            assert why == ["cudaDeviceEnablePeerAccess: peer mapping failed"], memo_run
        else:
            assert ok == "1", memo_run


def test_failed_pair_is_not_asked_again(memo_run):
    # Pair 0<-1: three calls (torch caches it); pair 1<-0: only the failing one.
    assert memo_run[-1] == "calls 4", memo_run


def test_cuda_branch_releases_the_gil():
    src = (CSRC / "bindings.cpp").read_text()
    start = src.index("std::vector<std::string> execute(")
    body = src[start:src.index("\n}\n", start)]
    cuda = body[body.index("#ifdef RINGREDUCE_WITH_CUDA"):]
    first_call = re.search(r"\n\s*(c10::|rr::|at::)", cuda)
    release = cuda.find("pybind11::gil_scoped_release")
    assert 0 <= release < first_call.start(), \
        "execute()'s CUDA branch must release the GIL before its first CUDA or torch call"
