#!/usr/bin/env python3
"""The all-reduce cost model of docs/COSTMODEL.md: predicted time and busbw on 2 to 8 distinct
GPUs over NVLink or PCIe, from per-step and per-byte costs measured on one GPU.

    python bench/costmodel.py                          # every parameter at its stated assumption
    python bench/costmodel.py --json ring4.json --json ring8.json   # fit from bench/ring.py runs
    python bench/costmodel.py --f 0.9 --ranks 8 --link nvlink --min-bytes 64K

--json takes the output of `bench/ring.py --json` run with simulated ranks on one GPU (one or
more files, e.g. --ranks 2, 4 and 8). Its ringreduce rows are fitted to the one-GPU form of the
model, t = t0 + 2(N-1)*alpha1 + 5(N-1)*S/B_hbm, by least squares on relative error; a flag given
beside it overrides the fitted value. Without --json, the parameters are the assumptions in
DEFAULTS, and the output says so on every line that uses one.

Prints, per link kind, a table in nccl-tests columns (size, ranks, then time / algbw / busbw for
the ring as the executor runs it today, the ring as one kernel per all-reduce, and the one-shot),
then the size below which the one-shot beats each ring. Exits 2 on bad arguments or a JSON file it
cannot use. Plain Python: no torch, no GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import common  # noqa: E402  (bench/ is not a package; its top level imports no torch)

US = 1e-6
GB = 1e9

# NCCL's ring all-reduce on 8 x H100 SXM (NVSwitch), large messages: "an effective NVLink
# bandwidth of 370GB/s, which you can observe as BusBw ... when running with NCCL_ALGO=RING"
# (S. Jeaugey, NVIDIA, https://github.com/NVIDIA/nccl-tests/issues/212). docs/COSTMODEL.md.
NCCL_RING_8XH100_BUSBW_GBPS = 370.0


@dataclass(frozen=True)
class Link:
    """One GPU's link to the others, per direction."""
    key: str
    title: str
    gbps: float        # line rate per direction, GB/s
    f: float           # fraction of it the pull kernels reach (an assumption, docs/COSTMODEL.md)
    flag_us: float     # one device-flag hop between two GPUs (an assumption)


LINKS = {
    # 18 NVLink 4 links x 25 GB/s per direction, all through the NVSwitches, so one peer can
    # take all of it (NVIDIA: 900 GB/s bidirectional per GPU).
    "nvlink": Link("nvlink", "NVLink 4 through NVSwitch (H100 SXM): 450 GB/s per direction",
                   450.0, 0.80, 1.0),
    # PCIe 5.0 x16: 32 GT/s x 16 lanes x 128/130 / 8 bits = 63.0 GB/s per direction; every GPU
    # under one switch that passes peer-to-peer traffic (no CPU socket crossing).
    "pcie": Link("pcie", "PCIe Gen5 x16, peer-to-peer under one switch: 63 GB/s per direction",
                 63.0, 0.80, 2.0),
}


@dataclass(frozen=True)
class Params:
    t0_us: float        # per call, whatever the rank count (Python, validation, bookkeeping)
    step_us: float      # alpha1: one ring step on one GPU, one lane (one kernel launch)
    hbm_gbps: float     # HBM bytes (read + written) per second the step kernels reach
    event_us: float     # host cost of one cudaEventRecord or cudaStreamWaitEvent
    wait_us: float      # GPU-side cost of one cross-device event dependency
    source: dict = field(default_factory=dict, compare=False)  # name -> where it came from


DEFAULTS = Params(t0_us=5.0, step_us=4.0, hbm_gbps=2600.0, event_us=1.0, wait_us=5.0,
                  source={name: "assumed" for name in
                          ("t0_us", "step_us", "hbm_gbps", "event_us", "wait_us")})

# HBM bytes per byte of a rank's chunk, per GPU and ring step: a reduce-scatter hop reads its
# own chunk, writes it, and serves its successor's read of it; an all-gather hop writes and is
# read. On one GPU with N simulated ranks the sum over a whole all-reduce is 5*S*(N-1)
# (bench/ring.py's roofline).
REDUCE_HBM = 3
COPY_HBM = 2


class BenchJsonError(ValueError):
    """A --json file this model cannot use; the message names the file and the rule."""


class FitError(ValueError):
    """Rows that do not determine the model's parameters."""


# ---------------------------------------------------------------------------------------------
# The model on one GPU (simulated ranks): what bench/ring.py measures, and what is fitted.

def one_gpu_time(size: float, nranks: int, p: Params) -> float:
    """Seconds for one all-reduce of `size` bytes per rank over `nranks` simulated ranks on one
    GPU and one stream: 2(N-1) dependent launches and 5(N-1)*S bytes through HBM."""
    return (p.t0_us * US + 2 * (nranks - 1) * p.step_us * US
            + 5 * (nranks - 1) * size / (p.hbm_gbps * GB))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """a x = b by Gaussian elimination with partial pivoting; FitError when singular."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            raise FitError("the rows do not determine the parameters (too few distinct sizes "
                           "or rank counts)")
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            k = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= k * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


@dataclass
class Fit:
    t0_us: float
    step_us: float
    hbm_gbps: float
    t0_fitted: bool     # False: one rank count, t0 held at the value given
    rms_rel: float      # root mean square of (model - measured) / measured
    rows: int


def fit_one_gpu(rows: list[tuple[int, int, float]], t0_us: float | None = None) -> Fit:
    """Least squares of t = t0 + 2(N-1)*alpha1 + 5(N-1)*S*c over (nranks, size, seconds) rows,
    on relative error (each row weighted by 1/t), so the microsecond rows fix the latencies and
    the millisecond rows the per-byte cost. t0 and alpha1 can only be told apart with two or
    more rank counts; with one, t0 is held at `t0_us` (default 0, which folds it into alpha1)."""
    if len(rows) < 2:
        raise FitError(f"need at least two timed rows, got {len(rows)}")
    counts = {n for n, _, _ in rows}
    fit_t0 = len(counts) >= 2 and t0_us is None
    held = 0.0 if t0_us is None else t0_us * US
    feats, targets = [], []
    for n, s, t in rows:
        if t <= 0:
            raise FitError(f"a non-positive time ({t} s) at N={n}, S={s}")
        x = [2.0 * (n - 1), 5.0 * (n - 1) * s]
        if fit_t0:
            x = [1.0] + x
        feats.append((x, t, t if fit_t0 else t - held))
    # Columns scaled to unit maximum: sizes span 1e9 against latencies of 1.
    k = len(feats[0][0])
    scale = [max(abs(x[j]) for x, _, _ in feats) or 1.0 for j in range(k)]
    a = [[0.0] * k for _ in range(k)]
    b = [0.0] * k
    for x, t, y in feats:
        w2 = 1.0 / (t * t)
        xs = [x[j] / scale[j] for j in range(k)]
        for i in range(k):
            b[i] += w2 * xs[i] * y
            for j in range(k):
                a[i][j] += w2 * xs[i] * xs[j]
    theta = [v / s for v, s in zip(_solve(a, b), scale)]
    t0 = theta[0] if fit_t0 else held
    alpha, c = theta[-2], theta[-1]
    if c <= 0:
        raise FitError(f"the fit gives a per-byte cost of {c:.3g} s/B (not positive): the rows "
                       "do not grow with size as t0 + 2(N-1)*alpha1 + 5(N-1)*S/B_hbm does; pass "
                       "--hbm-gbps")
    if alpha < 0 or t0 < 0:
        raise FitError(f"the fit gives negative latencies (t0 = {t0 / US:.3g} us, alpha1 = "
                       f"{alpha / US:.3g} us): pass --step-us (and --t0-us)")
    p = Params(t0 / US, alpha / US, 1 / c / GB, 0.0, 0.0)
    errs = [(one_gpu_time(s, n, p) - t) / t for n, s, t in rows]
    rms = math.sqrt(sum(e * e for e in errs) / len(errs))
    return Fit(t0 / US, alpha / US, 1 / c / GB, fit_t0, rms, len(rows))


@dataclass
class Run:
    path: str
    nranks: int
    rows: list[tuple[int, int, float]]   # (nranks, size, seconds)
    copy_gbps: float | None
    gpu: str


def load_run(path: str, impl: str = "ringreduce") -> Run:
    """The timed rows of `impl` in a bench/ring.py --json file from simulated ranks on one GPU.
    Rows with an error or #wrong > 0 are left out."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise BenchJsonError(f"{path}: cannot read it ({e.strerror or e})") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise BenchJsonError(f"{path}: not JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                             "expected the output of bench/ring.py --json") from e
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict) \
            or not isinstance(data.get("rows"), list):
        raise BenchJsonError(f"{path}: not a bench/ring.py --json output (needs an object with "
                             "'config' and 'rows')")
    cfg = data["config"]
    if cfg.get("device") != "cuda":
        raise BenchJsonError(
            f"{path}: measured on device {cfg.get('device')!r}; the model's per-step and "
            "per-byte costs come from a CUDA run with simulated ranks on one GPU "
            "(bench/ring.py --device cuda on a machine with one GPU)")
    devices = cfg.get("rank_devices")
    nranks = cfg.get("ranks")
    if not isinstance(nranks, int) or nranks < 2:
        raise BenchJsonError(f"{path}: config.ranks must be an integer >= 2, got {nranks!r}")
    if not isinstance(devices, list) or len(set(devices)) != 1:
        raise BenchJsonError(
            f"{path}: ranks on {devices!r}; the fit needs every rank on one GPU (its 5(N-1)*S "
            "HBM traffic); fitting a run over distinct GPUs is not implemented, give link "
            "figures with --f and --nvlink-gbps/--pcie-gbps instead")
    rows = []
    for i, row in enumerate(data["rows"]):
        try:
            size = int(row["size"])
            r = row["results"][impl]
        except (KeyError, TypeError, ValueError) as e:
            raise BenchJsonError(f"{path}: row {i} has no size or no results[{impl!r}] "
                                 f"({type(e).__name__}: {e})") from e
        if "time_us" not in r or r.get("wrong", 0):
            continue
        rows.append((nranks, size, float(r["time_us"]) * US))
    if len({s for _, s, _ in rows}) < 2:
        raise BenchJsonError(f"{path}: fewer than two sizes with a timed, correct {impl!r} row "
                             "(errors and #wrong > 0 are left out)")
    gpus = (cfg.get("cuda") or {}).get("gpus") or [{}]
    copy = cfg.get("copy_bandwidth_gbps")
    return Run(path, nranks, rows, float(copy) if copy else None,
               str(gpus[0].get("name", "unknown GPU")))


# ---------------------------------------------------------------------------------------------
# The model on N distinct GPUs, one rank each.

def _hop_seconds(size: float, nranks: int, link: Link, p: Params, hbm_per_byte: int) -> float:
    """One ring hop's data time: S/N bytes over the link and through HBM at once, so the slower
    of the two."""
    chunk = size / nranks
    return chunk * max(1 / (link.f * link.gbps * GB), hbm_per_byte / (p.hbm_gbps * GB))


def ring_time(size: float, nranks: int, link: Link, p: Params) -> float:
    """The executor as it is (csrc/ring/cuda_executor.cu): one host thread queues, per step and
    per GPU, a launch, an event record and a wait on the predecessor's event; an entry and an
    exit barrier (N records, and waits on each GPU's two ring neighbours: N min(2, N-1)). A step runs when the host has queued it on
    every GPU and the previous step is done; it costs a launch, a cross-device wait and the hop's
    data time."""
    n = nranks
    host_step = n * (p.step_us + 2 * p.event_us) * US
    host_barrier = n * (1 + min(2, n - 1)) * p.event_us * US
    host = host_barrier
    gpu = host + p.wait_us * US
    for k in range(2 * (n - 1)):
        host += host_step
        hbm = REDUCE_HBM if k < n - 1 else COPY_HBM
        gpu = max(gpu, host) + (p.step_us + p.wait_us) * US + _hop_seconds(size, n, link, p, hbm)
    host += host_barrier
    gpu = max(gpu, host) + p.wait_us * US
    return p.t0_us * US + gpu


def persistent_ring_time(size: float, nranks: int, link: Link, p: Params) -> float:
    """The fast-path design (docs/DESIGN.md, "One kernel per collective"): one launch per GPU,
    every step inside it ordered by a device flag, plus a final flag before the buffers may be
    reused. The hops move the same bytes at the same f."""
    n = nranks
    t = p.t0_us * US + n * p.step_us * US + link.flag_us * US
    for k in range(2 * (n - 1)):
        hbm = REDUCE_HBM if k < n - 1 else COPY_HBM
        t += link.flag_us * US + _hop_seconds(size, n, link, p, hbm)
    return t


def oneshot_time(size: float, nranks: int, link: Link, p: Params) -> float:
    """Each GPU reads every peer's S bytes and writes its own result (the per-GPU form of
    csrc/ring/oneshot.h, with device flags): one launch per GPU, a flag barrier before the reads
    and one after them (in place, no rank may write before every peer has read). Per GPU, the
    link carries (N-1)*S each way and HBM (N+1)*S (own read and write, N-1 peers' reads)."""
    n = nranks
    data = size * max((n - 1) / (link.f * link.gbps * GB), (n + 1) / (p.hbm_gbps * GB))
    return p.t0_us * US + n * p.step_us * US + 2 * link.flag_us * US + data


def busbw_limit_gbps(link: Link, p: Params) -> float:
    """The ring's busbw as S grows (both ring forms): 2(N-1) hops of S/N, each limited by the
    link or by HBM, so busbw = S/T * 2(N-1)/N -> 2 / (hop cost of a reduce + of a copy), per byte.
    It is f * B_link while the link is the bottleneck of both kinds of hop."""
    link_cost = 1 / (link.f * link.gbps)
    return 2 / (max(link_cost, REDUCE_HBM / p.hbm_gbps) + max(link_cost, COPY_HBM / p.hbm_gbps))


def crossover(ring, oneshot, lo: int = 8, hi: int = 1 << 40) -> int | None:
    """The smallest size S in [lo, hi] with ring(S) <= oneshot(S): the one-shot is faster below
    it. None: the one-shot is faster over the whole range. Every term of the model is linear in
    S (or a maximum of such terms), so the two curves cross at most once."""
    if ring(lo) <= oneshot(lo):
        return lo
    if ring(hi) > oneshot(hi):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ring(mid) <= oneshot(mid):
            hi = mid
        else:
            lo = mid
    return hi


# ---------------------------------------------------------------------------------------------
# Output.

KEY_COLUMNS = [common.Column("size", "(B)", 12, "d"), common.Column("ranks", "", 5, "d")]
IMPL_COLUMNS = [common.Column("time", "(us)", 10, ".1f"),
                common.Column("algbw", "(GB/s)", 8, ".2f"),
                common.Column("busbw", "(GB/s)", 8, ".2f")]
MODELS = [("ring (today)", ring_time), ("ring (one kernel)", persistent_ring_time),
          ("one-shot", oneshot_time)]


def busbw_gbps(size: int, seconds: float, nranks: int) -> float:
    return common.bandwidths(size, seconds, 2 * (nranks - 1) / nranks)[1]


def prediction_rows(link: Link, p: Params, ranks: list[int], sizes: list[int]) -> list[dict]:
    rows = []
    for n in ranks:
        for s in sizes:
            row = {"link": link.key, "ranks": n, "size": s}
            for name, model in MODELS:
                t = model(s, n, link, p)
                alg, bus = common.bandwidths(s, t, 2 * (n - 1) / n)
                row[name] = {"time_us": t / US, "algbw_gbps": alg, "busbw_gbps": bus}
            rows.append(row)
    return rows


def describe_params(p: Params) -> list[str]:
    def src(name):
        return p.source.get(name, "assumed")
    return [
        f"#   t0      = {p.t0_us:8.2f} us      per call, fixed ({src('t0_us')})",
        f"#   alpha1  = {p.step_us:8.2f} us      one ring step, one GPU, one lane "
        f"({src('step_us')})",
        f"#   B_hbm   = {p.hbm_gbps:8.1f} GB/s    HBM bytes read + written per second by the "
        f"step kernels ({src('hbm_gbps')})",
        f"#   h_event = {p.event_us:8.2f} us      host cost of one event record or wait "
        f"({src('event_us')})",
        f"#   w_sync  = {p.wait_us:8.2f} us      GPU cost of one cross-device event "
        f"dependency ({src('wait_us')})",
    ]


def _below(nbytes: int | None) -> str:
    if nbytes is None:
        return "at every size up to 1 TiB"
    for unit, scale in (("GiB", common.GiB), ("MiB", common.MiB), ("KiB", common.KiB)):
        if nbytes >= scale:
            return f"below {nbytes / scale:.3g} {unit}"
    return f"below {nbytes} B"


def report(p: Params, links: list[Link], ranks: list[int], sizes: list[int], log) -> None:
    table = common.Table(KEY_COLUMNS, [(name, IMPL_COLUMNS) for name, _ in MODELS])
    for link in links:
        log("#")
        log(f"# {link.title}; f = {link.f:.2f} of it reached (assumed), so "
            f"{link.f * link.gbps:.0f} GB/s; device flag hop {link.flag_us:g} us (assumed)")
        for line in table.header():
            log(line)
        for row in prediction_rows(link, p, ranks, sizes):
            cells = [[row[name][k] for k in ("time_us", "algbw_gbps", "busbw_gbps")]
                     for name, _ in MODELS]
            log(table.row([row["size"], row["ranks"]], cells))
        log(f"# ring busbw as S grows: {busbw_limit_gbps(link, p):.0f} GB/s (f*B_link = "
            f"{link.f * link.gbps:.0f} GB/s while the link, not HBM, limits every hop)")
        if link.key == "nvlink" and 8 in ranks:
            big = sizes[-1]
            for name, model in MODELS[:2]:
                bus = busbw_gbps(big, model(big, 8, link, p), 8)
                log(f"# N=8 at {common.format_size(big)}: {name} {bus:.0f} GB/s busbw = "
                    f"{100 * bus / NCCL_RING_8XH100_BUSBW_GBPS:.0f}% of NCCL's ring "
                    f"({NCCL_RING_8XH100_BUSBW_GBPS:.0f} GB/s, nccl-tests issue 212)")
        for n in ranks:
            def one(s, n=n, link=link):
                return oneshot_time(s, n, link, p)
            today = crossover(lambda s, n=n, link=link: ring_time(s, n, link, p), one)
            fast = crossover(lambda s, n=n, link=link: persistent_ring_time(s, n, link, p), one)
            log(f"# one-shot faster, N={n}: than the ring today {_below(today)}; than the ring "
                f"as one kernel {_below(fast)}")


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="bench/costmodel.py",
        description="Predicted all-reduce time and busbw on 2-8 distinct GPUs over NVLink or "
                    "PCIe (docs/COSTMODEL.md), from one-GPU measurements or stated assumptions.")
    p.add_argument("--json", action="append", default=[], metavar="PATH",
                   help="bench/ring.py --json output from simulated ranks on one GPU; repeat "
                        "for several rank counts (two or more also fit t0)")
    p.add_argument("--impl", default="ringreduce",
                   help="which implementation's rows to fit (default ringreduce)")
    p.add_argument("--t0-us", type=float, help=f"per-call fixed cost (default: fitted, else "
                                               f"{DEFAULTS.t0_us:g})")
    p.add_argument("--step-us", type=float, help=f"alpha1, one ring step on one GPU (default: "
                                                 f"fitted, else {DEFAULTS.step_us:g})")
    p.add_argument("--hbm-gbps", type=float, help=f"HBM bytes per second reached by the step "
                                                  f"kernels (default: fitted, else "
                                                  f"{DEFAULTS.hbm_gbps:g})")
    p.add_argument("--event-us", type=float,
                   help=f"host cost of one cudaEventRecord / cudaStreamWaitEvent (assumed "
                        f"{DEFAULTS.event_us:g})")
    p.add_argument("--wait-us", type=float,
                   help=f"GPU cost of one cross-device event dependency (assumed "
                        f"{DEFAULTS.wait_us:g})")
    p.add_argument("--f", type=float, help="fraction of the link rate reached, for every link "
                                           "(default 0.80 each)")
    p.add_argument("--nvlink-gbps", type=float, default=LINKS["nvlink"].gbps)
    p.add_argument("--pcie-gbps", type=float, default=LINKS["pcie"].gbps)
    p.add_argument("--link", choices=("nvlink", "pcie", "both"), default="both")
    p.add_argument("--ranks", default="2,4,8", help="rank counts, comma-separated (default "
                                                    "%(default)s)")
    p.add_argument("--min-bytes", type=common.parse_size, default=common.MiB,
                   help="smallest size per rank (default 1M)")
    p.add_argument("--max-bytes", type=common.parse_size, default=common.GiB,
                   help="largest size per rank (default 1G)")
    args = p.parse_args(argv)
    return p, args


def make_params(parser, args, log) -> Params:
    p = DEFAULTS
    source = dict(DEFAULTS.source)
    if args.json:
        try:
            runs = [load_run(path, args.impl) for path in args.json]
            fit = fit_one_gpu([r for run in runs for r in run.rows], args.t0_us)
        except (BenchJsonError, FitError) as e:
            parser.error(str(e))
        where = ", ".join(f"{run.path} (N={run.nranks}, {run.gpu})" for run in runs)
        p = replace(p, t0_us=fit.t0_us, step_us=fit.step_us, hbm_gbps=fit.hbm_gbps)
        source.update(step_us="fitted", hbm_gbps="fitted",
                      t0_us="fitted" if fit.t0_fitted else "held: one rank count")
        log(f"# fit of {fit.rows} {args.impl} rows from {where}: rms relative error "
            f"{100 * fit.rms_rel:.1f}%")
        for run in runs:
            if run.copy_gbps:
                log(f"#   {run.path}: B_hbm is {100 * fit.hbm_gbps / run.copy_gbps:.0f}% of the "
                    f"copy bandwidth measured in that run ({run.copy_gbps:.0f} GB/s)")
        if not fit.t0_fitted and args.t0_us is None:
            log("#   one rank count: t0 cannot be told from alpha1 and is folded into it "
                "(alpha1 is an upper bound); give runs at two rank counts, or --t0-us")
    for name in ("t0_us", "step_us", "hbm_gbps", "event_us", "wait_us"):
        value = getattr(args, name)
        if value is None:
            continue
        if value < 0 or (name == "hbm_gbps" and value == 0):
            parser.error(f"--{name.replace('_', '-')} must be "
                         f"{'positive' if name == 'hbm_gbps' else '>= 0'}, got {value}")
        p = replace(p, **{name: value})
        source[name] = "given"
    return Params(p.t0_us, p.step_us, p.hbm_gbps, p.event_us, p.wait_us, source)


def main(argv=None, out=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    out = out or sys.stdout

    def log(line=""):
        print(line, file=out, flush=True)

    parser, args = parse_args(argv)
    try:
        ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--ranks must be comma-separated integers, got {args.ranks!r}")
    if not ranks or min(ranks) < 2:
        parser.error(f"--ranks must be integers >= 2, got {args.ranks!r}")
    if args.f is not None and not 0 < args.f <= 1:
        parser.error(f"--f must be in (0, 1], got {args.f}")
    for name in ("nvlink_gbps", "pcie_gbps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    try:
        sizes = common.doubling_sizes(args.min_bytes, args.max_bytes, 1)
    except ValueError as e:
        parser.error(f"--min-bytes/--max-bytes: {e}")
    links = []
    for key in (("nvlink", "pcie") if args.link == "both" else (args.link,)):
        link = replace(LINKS[key], gbps=getattr(args, f"{key}_gbps"))
        links.append(link if args.f is None else replace(link, f=args.f))

    log("# bench/costmodel.py: predicted all_reduce on N distinct GPUs, one rank each "
        "(docs/COSTMODEL.md); a model, not a measurement")
    log(f"# command: {common.command_line(['bench/costmodel.py', *argv])}")
    p = make_params(parser, args, log)
    log("# parameters (source):")
    for line in describe_params(p):
        log(line)
    report(p, links, ranks, sizes, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
