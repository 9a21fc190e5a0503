"""Progress bars for the trainer and the benchmarks: tqdm on stderr, or none at all.

A bar is drawn only where someone watches it: stderr is a terminal and the command was not
given --quiet. Elsewhere (a log file, a pipe, a test capturing the output) nothing is written,
so what a script reads from stdout and stderr does not depend on the bars. tqdm is optional at
run time (the offline GPU machine may not have it): without it a command runs without bars and
says so once on stderr.
"""
import contextlib
import sys
import time

# tqdm's own default redraw interval; a postfix is computed no more often than this.
REDRAW_S = 0.1

_said_missing = False


def add_quiet_argument(parser):
    """--quiet, the same for the trainer and the benchmarks."""
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bars (drawn on stderr only when it is a terminal)")


def _tqdm(stream):
    """tqdm's class, or None (saying so once on `stream`) where tqdm is not installed."""
    global _said_missing
    try:
        from tqdm import tqdm
    except ImportError:
        if not _said_missing:
            _said_missing = True
            print("ringreduce: tqdm is not installed, so no progress bars (pip install tqdm)",
                  file=stream, flush=True)
        return None
    return tqdm


def _is_terminal(stream):
    isatty = getattr(stream, "isatty", None)
    return isatty is not None and isatty()


class Progress:
    """A bar over `total` steps labelled `desc` on `stream` (default: sys.stderr at the call),
    or nothing where the module's docstring says so. Use as a context manager, or close().

    update(n, postfix) advances by n; postfix is a string or a function returning one, called
    only when the bar will show it (at most every REDRAW_S and at the last step), so a caller
    can pass something costly to compute, such as a loss read back from the GPU.
    leave=False removes the bar when it closes (for bars between the rows of a table)."""

    def __init__(self, total, desc, quiet=False, leave=True, unit="it", stream=None):
        stream = sys.stderr if stream is None else stream
        self.total = total
        self._done = 0
        self._postfix_at = None
        self._bar = None
        if quiet or not _is_terminal(stream):
            return
        tqdm = _tqdm(stream)
        if tqdm is not None:
            self._bar = tqdm(total=total, desc=desc, leave=leave, unit=unit, file=stream,
                             dynamic_ncols=True, mininterval=REDRAW_S)

    @property
    def shown(self):
        """Whether a bar is drawn."""
        return self._bar is not None

    def update(self, n=1, postfix=None):
        self._done += n
        if self._bar is None:
            return
        if postfix is not None:
            now = time.monotonic()
            if (self._done >= self.total or self._postfix_at is None
                    or now - self._postfix_at >= REDRAW_S):
                self._postfix_at = now
                self._bar.set_postfix_str(postfix() if callable(postfix) else postfix,
                                          refresh=False)
        self._bar.update(n)

    @contextlib.contextmanager
    def hidden(self):
        """Clears the bar while the caller prints (a table row on stdout that shares the
        terminal), then draws it again below what was printed."""
        if self._bar is None:
            yield
            return
        self._bar.clear()
        try:
            yield
        finally:
            self._bar.refresh()

    def close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
