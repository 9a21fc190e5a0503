#!/usr/bin/env python3
"""Turns the frames that scripts/segv_backtrace.c printed into functions and source lines.

    python3 scripts/symbolize_backtraces.py LOG...

For every "segv_backtrace:" block in each LOG it prints the block again with each frame
resolved: "file(+0xOFFSET)" through `addr2line -C -f -i -e file` (functions hidden from the
dynamic symbol table, as the extension's are, resolve from the file's own symbol table), and
"file(symbol+0xOFFSET)" demangled. Run it where the crashing build still is (on the GPU machine,
in the same command): the offsets mean nothing against another build. Prints nothing for a log
without blocks; exit status 0 unless a LOG cannot be read."""
import re
import shutil
import subprocess
import sys

FRAME = re.compile(r"^(?P<file>[^(\s]+)\((?P<sym>[^+)]*)\+(?P<off>0x[0-9a-fA-F]+)\)\s*"
                   r"\[(?P<addr>0x[0-9a-fA-F]+)\]")


def addr2line(path, offset):
    tool = shutil.which("addr2line")
    if tool is None:
        return None
    try:
        out = subprocess.run([tool, "-C", "-f", "-i", "-e", path, offset], capture_output=True,
                             text=True, timeout=60).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    pairs = [f"{out[i]} at {out[i + 1]}" for i in range(0, len(out) - 1, 2)]
    return " <- inlined in ".join(pairs) if pairs and not out[0].startswith("??") else None


def demangle(symbol):
    tool = shutil.which("c++filt")
    if tool is None or not symbol:
        return symbol
    try:
        return subprocess.run([tool, symbol], capture_output=True, text=True,
                              timeout=60).stdout.strip() or symbol
    except (OSError, subprocess.SubprocessError):
        return symbol


def symbolize(lines):
    """The resolved text of every block in `lines` (a list of strings)."""
    out, inside = [], False
    for line in lines:
        if line.startswith("segv_backtrace: signal"):
            inside = True
            out.append(line.rstrip("\n"))
            continue
        if not inside:
            continue
        if line.startswith("segv_backtrace: end"):
            out.append("segv_backtrace: end")
            inside = False
            continue
        m = FRAME.match(line.strip())
        if m is None:
            out.append("  " + line.strip())
            continue
        where = addr2line(m["file"], m["off"]) if not m["sym"] else None
        name = where or (demangle(m["sym"]) + "+" + m["off"] if m["sym"] else "?? +" + m["off"])
        out.append(f"  {name}  [{m['file']}]")
    return out


def main(paths):
    for path in paths:
        with open(path, errors="replace") as f:
            resolved = symbolize(f.readlines())
        if resolved:
            print(f"== {path}: native stacks, resolved")
            print("\n".join(resolved))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
