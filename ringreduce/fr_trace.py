"""torch's flight recorder analyzer, for dumps that hold ringreduce's entries.

    python -m ringreduce.fr_trace DIR [torch's fr_trace options]

is `python -m torch.distributed.flight_recorder.fr_trace DIR ...` (the same code, arguments
and output) with one change: torch's analyzer accepts only the backends it knows by name in an
entry's profiling name (nccl, gloo, xccl, ...; torch 2.11 to 2.14.1) and stops on
"ringreduce:all_reduce" with "name formatting error? ringreduce not in {...}". Here an entry
named "ringreduce:<op>" is read as the analyzer reads any backend's "<backend>:<op>" (the
backend's name plays no other part in it), and its name is shown as recorded. A receive from
any source (recorded "recv 2<-*", which no analyzer entry can name) is read as a receive from
an unknown rank: it matches no send.

The dumps are the ones ringreduce writes on a failure (TORCH_FR_DUMP_TEMP_FILE + rank) or
torch._C._distributed_c10d._dump_fr_trace writes; docs/BACKEND.md ("Flight recorder") has the
workflow.
"""
import sys

BACKEND = "ringreduce"
# A name torch's analyzer accepts in place of ours while it parses an entry.
_STAND_IN = "gloo"


def accept_ringreduce_entries():
    """Makes torch's analyzer (its Op class) read "ringreduce:<op>" entries. Idempotent."""
    from torch.distributed.flight_recorder.components import types

    parse = types.Op.__init__
    if getattr(parse, "_ringreduce", False):
        return

    def __init__(self, event, memberships, pg_name):
        name = event["profiling_name"]
        backend, _, op = name.partition(":")
        if backend != BACKEND:
            parse(self, event, memberships, pg_name)
            return
        any_source = op.startswith("recv ") and op.endswith("<-*")
        if any_source:
            rank = op[len("recv "):-len("<-*")]
            op = f"recv {rank}<-{rank}"
        parse(self, dict(event, profiling_name=f"{_STAND_IN}:{op}"), memberships, pg_name)
        self.profiling_name = name
        if any_source:
            self._src = self._src_g = None

    __init__._ringreduce = True
    types.Op.__init__ = __init__


def main(argv=None):
    accept_ringreduce_entries()
    from torch.distributed.flight_recorder import fr_trace

    return fr_trace.main(argv)


if __name__ == "__main__":
    sys.exit(main())
