"""Runs torch's own distributed conformance suite on a backend: the tests of
``torch.testing._internal.distributed.distributed_test`` (class ``DistributedTest._DistTestBase``),
driven the way torch's test/distributed/test_distributed_spawn.py drives them (BACKEND,
WORLD_SIZE and TEMP_DIR set, one spawned process per rank and test).

    python scripts/torch_suite.py --backend ringreduce --world-size 2
    python scripts/torch_suite.py --backend gloo --world-size 2 -k all_reduce
    python scripts/torch_suite.py --compare --world-size 2       # gloo, then ringreduce
    python scripts/torch_suite.py --compare --gloo-json g.json --ringreduce-json r.json

Three changes to the suite as torch runs it:
- ringreduce is declared a plugin backend with the features it has
  (``DistTestCases.backend_feature``: "plugin", "ddp", "subgroup", "gpu", "cuda").
- The module is loaded with its gloo-only and MPI-only feature gates widened to ringreduce
  (``BACKEND != "gloo"`` becomes ``BACKEND not in ("gloo", "ringreduce")``, and so on: see
  _WidenGates), so ringreduce runs every test gloo runs, and the CPU all-to-all tests torch
  runs for MPI only. The source is rewritten on its syntax tree (any torch whose gates are
  written so works; the runner stops if it finds none) and executed as the module itself, so
  that pickles of its classes resolve. Nothing changes for gloo.
- ringreduce joins the suite's lists of backends whose profiler events it checks
  (``PROFILING_SUPPORTED_BACKENDS``, and the CUDA and send/recv ones), so the suite checks
  ringreduce's ``ringreduce:<op>`` events and their input shapes as it checks gloo's.

Tests in scripts/torch_suite_excluded.txt are not run on ringreduce (each with its reason).

Prints one line per test (PASS, FAIL, TIMEOUT, SKIP, EXCLUDED) and a summary; the tests' own
output goes to a log file (--log). --compare lists the gap: tests gloo passes that ringreduce
does not, and tests ringreduce runs (widened gates) and fails. Exit status 1 when there is a
gap not in scripts/torch_suite_known_gaps.txt (gaps being worked on, with the reason), or a
known gap that passes now (so the list stays true); with --strict, on any gap.
--start-method fork starts each test's ranks by fork instead of spawn: they inherit the imported
torch and suite instead of importing them again (on a 2-core machine at load 7, 0.5 s a test
instead of 25 s). Use it on CPU-only machines (a forked rank cannot use CUDA reliably).
Each test is bounded by --test-timeout seconds (torch's per-test timeout, whose own longer
overrides for a few slow tests stay).
"""
import argparse
import ast
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
EXCLUDED_FILE = os.path.join(HERE, "torch_suite_excluded.txt")
KNOWN_GAPS_FILE = os.path.join(HERE, "torch_suite_known_gaps.txt")
SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"
PLUGIN = "ringreduce"
# The features ringreduce has, in DistTestCases.backend_feature's terms.
PLUGIN_FEATURES = ("plugin", "ddp", "subgroup", "gpu", "cuda")
CLASS_NAME = "TestDistBackendWithSpawn"
START_METHOD_ENV = "RINGREDUCE_SUITE_START_METHOD"  # how the ranks start (--start-method)
# The suite's lists of the backends whose profiler events it checks; ringreduce joins them.
PROFILING_LISTS = ("PROFILING_SUPPORTED_BACKENDS", "CUDA_PROFILING_SUPPORTED_BACKENDS",
                   "SEND_RECV_PROFILING_SUPPORTED_BACKENDS")


class _WidenGates(ast.NodeTransformer):
    """Widens the suite's gloo-only and MPI-only gates to ringreduce; counts what it rewrote.

    ``BACKEND == "gloo"`` and ``BACKEND != "gloo"`` anywhere (one test helper picks its CPU path
    with ``BACKEND == "mpi" or BACKEND == "gloo"``), ``BACKEND != "mpi"`` (the CPU all-to-all
    and get_future gates; ``BACKEND == "mpi"`` only ever skips), and
    ``require_backend_is_available({"gloo"})``.
    """

    def __init__(self):
        self.count = 0

    def visit_Compare(self, node):
        self.generic_visit(node)
        if not (isinstance(node.left, ast.Name) and node.left.id == "BACKEND"
                and len(node.ops) == 1 and isinstance(node.comparators[0], ast.Constant)):
            return node
        value, op = node.comparators[0].value, node.ops[0]
        if value == "gloo" and isinstance(op, (ast.Eq, ast.NotEq)):
            new_op = ast.In() if isinstance(op, ast.Eq) else ast.NotIn()
        elif value == "mpi" and isinstance(op, ast.NotEq):
            new_op = ast.NotIn()
        else:
            return node
        self.count += 1
        names = ast.Tuple([ast.Constant(value), ast.Constant(PLUGIN)], ast.Load())
        return ast.copy_location(ast.Compare(node.left, [new_op], [names]), node)

    def visit_Call(self, node):
        self.generic_visit(node)
        if (isinstance(node.func, ast.Name) and node.func.id == "require_backend_is_available"
                and len(node.args) == 1 and isinstance(node.args[0], ast.Set)
                and any(isinstance(e, ast.Constant) and e.value == "gloo"
                        for e in node.args[0].elts)):
            self.count += 1
            node.args[0].elts.append(ast.copy_location(ast.Constant(PLUGIN), node.args[0]))
        return node


def _load_widened_suite():
    """Executes the suite's source with its gates widened, as the module itself."""
    spec = importlib.util.find_spec(SUITE_MODULE)
    with open(spec.origin) as f:
        source = f.read()
    widen = _WidenGates()
    tree = widen.visit(ast.parse(source, spec.origin))
    if widen.count == 0:
        raise RuntimeError(f"torch_suite: no gloo/MPI-only gate found in {spec.origin}; this "
                           "torch writes its gates differently: update _WidenGates")
    ast.fix_missing_locations(tree)
    module = importlib.util.module_from_spec(spec)
    sys.modules[SUITE_MODULE] = module
    exec(compile(tree, spec.origin, "exec"), module.__dict__)
    # The profiler checks too: ringreduce records "ringreduce:<op>" events as gloo does.
    for name in PROFILING_LISTS:
        backends = getattr(module, name, None)
        if backends is None or "gloo" not in backends:
            raise RuntimeError(f"torch_suite: {spec.origin} has no {name} holding gloo; this "
                               "torch gates its profiler checks differently: update "
                               "PROFILING_LISTS")
        backends.append(PLUGIN)
    return module, widen.count


def _define_suite_class():
    """The suite's test class, as test_distributed_spawn.py defines it; env already set."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.common_distributed import DistTestCases

    if os.environ["BACKEND"] == PLUGIN:
        import ringreduce  # noqa: F401  (registers the backend)
        for feature in PLUGIN_FEATURES:
            DistTestCases.backend_feature.setdefault(feature, set()).add(PLUGIN)
    assert dist.is_available()
    suite, gates = _load_widened_suite()

    class TestDistBackendWithSpawn(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            if os.environ.get(START_METHOD_ENV, "spawn") == "fork":
                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            else:
                self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    TestDistBackendWithSpawn.__qualname__ = CLASS_NAME
    globals()[CLASS_NAME] = TestDistBackendWithSpawn
    return TestDistBackendWithSpawn, gates


# The ranks are spawned processes: they run this file as __mp_main__ and find the class here.
if __name__ == "__mp_main__":
    _define_suite_class()


def read_excluded(path=EXCLUDED_FILE):
    """{test name: reason} from a list of "name: reason" lines (# comments): the excluded
    tests, or the known gaps."""
    excluded = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name, sep, reason = line.partition(":")
            if not sep or not name.strip().startswith("test_") or not reason.strip():
                raise ValueError(f"{path}:{number}: expected 'test_name: reason'; got {line!r}")
            excluded[name.strip()] = reason.strip()
    return excluded


class _Result(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.status, self.detail = "PASS", ""

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._failed(self.failures[-1][1])

    def addError(self, test, err):
        super().addError(test, err)
        self._failed(self.errors[-1][1])

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.status, self.detail = "SKIP", str(reason)

    def _failed(self, text):
        # The harness's words when it ended a test's processes at the per-test timeout.
        timed_out = re.search(r"Process \d+ terminated or timed out after", text)
        self.status, self.detail = ("TIMEOUT" if timed_out else "FAIL"), text


def _summary_line(detail):
    """The line of a failure's text that says most: the last exception line."""
    lines = [ln.strip() for ln in detail.splitlines() if ln.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Timeout)\b", line):
            return line[:300]
    return lines[-1][:300] if lines else ""


def _redirect_output(log_path):
    """Sends this process's (and its children's) stdout/stderr to `log_path`; returns a file
    on the original stdout for the report."""
    report = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    return report


def run_suite(args):
    """Runs the selected tests in this process (one spawned process per rank and test)."""
    os.environ["BACKEND"] = args.backend
    os.environ["WORLD_SIZE"] = str(args.world_size)
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="torch_suite_"))
    os.makedirs(os.path.join(os.environ["TEMP_DIR"], "barrier"), exist_ok=True)
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(args.test_timeout)
    os.environ[START_METHOD_ENV] = args.start_method
    cls, gates = _define_suite_class()
    report = _redirect_output(args.log) if args.log else sys.stdout
    excluded = read_excluded() if args.backend == PLUGIN else {}
    names = list(unittest.TestLoader().getTestCaseNames(cls))
    if args.k:
        names = [n for n in names if any(re.search(k, n) for k in args.k)]
    shard, shards = args.shard
    names = names[shard::shards]
    print(f"# torch {sys.modules['torch'].__version__}, backend {args.backend}, world size "
          f"{args.world_size}, {len(names)} tests, {gates} gates widened, per-test timeout "
          f"{args.test_timeout}s, ranks started by {args.start_method}", file=report)
    results = {}
    start = time.time()
    out = {"backend": args.backend, "world_size": args.world_size,
           "torch": sys.modules["torch"].__version__, "complete": not names, "seconds": 0.0,
           "results": results}
    for name in names:
        if name in excluded:
            results[name] = {"status": "EXCLUDED", "detail": excluded[name], "seconds": 0.0}
        else:
            t0 = time.time()
            print(f"## {name}", flush=True)
            result = _Result()
            cls(name).run(result)
            results[name] = {"status": result.status, "detail": result.detail,
                             "seconds": round(time.time() - t0, 1)}
            if result.status in ("FAIL", "TIMEOUT"):
                print(result.detail, flush=True)
        r = results[name]
        note = _summary_line(r["detail"]) if r["status"] in ("FAIL", "TIMEOUT") else r["detail"]
        print(f"{r['status']:8} {name} ({r['seconds']}s){'  ' + note if note else ''}",
              file=report, flush=True)
        out = {"backend": args.backend, "world_size": args.world_size,
               "torch": sys.modules["torch"].__version__, "complete": len(results) == len(names),
               "seconds": round(time.time() - start, 1), "results": results}
        if args.json:  # after every test: a run cut short still leaves what it found
            with open(args.json + ".tmp", "w") as f:
                json.dump(out, f, indent=1)
            os.replace(args.json + ".tmp", args.json)
    print_summary(out, report)
    return out


def count(out):
    counts = {}
    for r in out["results"].values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    return counts


def print_summary(out, file=sys.stdout):
    counts = ", ".join(f"{v} {k.lower()}" for k, v in sorted(count(out).items()))
    cut = "" if out.get("complete", True) else ", CUT SHORT (not every test ran)"
    print(f"# {out['backend']} world size {out['world_size']}: {counts} "
          f"({out['seconds']:.0f}s{cut})", file=file, flush=True)


def gap(gloo, plugin):
    """{test: (gloo status, ringreduce status, note)}: what gloo passes and ringreduce does not
    (excluded tests aside), and what ringreduce fails where gloo did not fail."""
    found = {}
    for name, r in plugin["results"].items():
        g = gloo["results"].get(name, {"status": "NOT RUN"})
        if r["status"] in ("PASS", "EXCLUDED"):
            continue
        if g["status"] == "PASS" or (r["status"] in ("FAIL", "TIMEOUT")
                                      and g["status"] not in ("FAIL", "TIMEOUT")):
            note = _summary_line(r["detail"]) if r["status"] != "SKIP" else r["detail"]
            found[name] = (g["status"], r["status"], note)
    return found


def _shard_spec(text):
    shard, _, shards = text.partition("/")
    shard, shards = int(shard), int(shards)
    if not 0 <= shard < shards:
        raise argparse.ArgumentTypeError(f"--shard must be i/n with 0 <= i < n; got {text}")
    return shard, shards


def _run_child(args, backend, json_path):
    """Runs one backend's suite in a fresh interpreter (the suite's module is per backend)."""
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--backend", backend, "--world-size",
           str(args.world_size), "--test-timeout", str(args.test_timeout), "--json", json_path,
           "--start-method", args.start_method,
           "--shard", f"{args.shard[0]}/{args.shard[1]}"]
    cmd += [x for k in args.k or () for x in ("-k", k)]
    if args.log:
        cmd += ["--log", f"{args.log}.{backend}"]
    subprocess.run(cmd, check=False)
    with open(json_path) as f:
        return json.load(f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=PLUGIN, help="gloo or ringreduce (default)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("-k", action="append", metavar="REGEX",
                        help="run only tests whose name matches (repeatable)")
    parser.add_argument("--test-timeout", type=int, default=300,
                        help="seconds per test (torch's default timeout; default 300)")
    parser.add_argument("--start-method", choices=("spawn", "fork"), default="spawn",
                        help="how each test's ranks start: spawn (default, as torch's runner: "
                        "each rank imports torch and the suite again) or fork (they inherit "
                        "them: ~50x faster on a loaded machine; CPU-only machines)")
    parser.add_argument("--shard", type=_shard_spec, default=(0, 1), metavar="I/N",
                        help="run every N-th test from the I-th (0-based)")
    parser.add_argument("--json", help="write the results here (with --compare: to JSON.gloo "
                        "and JSON.ringreduce)")
    parser.add_argument("--log", help="the tests' own output goes here (default: the terminal)")
    parser.add_argument("--compare", action="store_true",
                        help="run gloo, then ringreduce; list the gap; exit 1 if there is one")
    parser.add_argument("--gloo-json", help="with --compare: gloo's results from an earlier run")
    parser.add_argument("--ringreduce-json", help="with --compare: ringreduce's earlier results")
    parser.add_argument("--known-gaps", default=KNOWN_GAPS_FILE, metavar="FILE",
                        help="with --compare: the list of known gaps (default "
                        "scripts/torch_suite_known_gaps.txt)")
    parser.add_argument("--strict", action="store_true",
                        help="with --compare: known gaps fail the run too")
    args = parser.parse_args()
    if args.world_size < 2:
        parser.error(f"--world-size must be at least 2; got {args.world_size}")
    if not args.compare:
        out = run_suite(args)
        bad = [n for n, r in out["results"].items() if r["status"] in ("FAIL", "TIMEOUT")]
        return 1 if bad else 0

    with tempfile.TemporaryDirectory(prefix="torch_suite_") as tmp:
        runs = {}
        for backend, given in (("gloo", args.gloo_json), (PLUGIN, args.ringreduce_json)):
            if given:
                with open(given) as f:
                    runs[backend] = json.load(f)
            else:
                path = f"{args.json}.{backend}" if args.json else os.path.join(tmp, backend)
                runs[backend] = _run_child(args, backend, path)
    for out in runs.values():
        print_summary(out)
    missing = gap(runs["gloo"], runs[PLUGIN])
    known = read_excluded(args.known_gaps)
    print(f"# gap: {len(missing)} tests (gloo status, ringreduce status), "
          f"{len(set(missing) & set(known))} of them known ({os.path.relpath(args.known_gaps)})")
    for name, (g, r, note) in sorted(missing.items()):
        tag = "KNOWN" if name in known else "GAP"
        print(f"{tag:8} {name}: gloo {g}, ringreduce {r}{'  ' + note if note else ''}")
    # A known gap that ran and is gone: the list must say so (remove it there).
    closed = sorted(n for n in known if runs[PLUGIN]["results"].get(n, {}).get("status") == "PASS")
    for name in closed:
        print(f"CLOSED   {name}: passes now; remove it from {os.path.relpath(args.known_gaps)}")
    unknown = set(missing) - set(known)
    if not all(out.get("complete", True) for out in runs.values()):
        print("# a run was cut short: the comparison is incomplete")
        return 1
    if args.strict:
        return 1 if missing else 0
    return 1 if unknown or closed else 0


if __name__ == "__main__":
    sys.exit(main())
