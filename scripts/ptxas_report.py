#!/usr/bin/env python3
"""ptxas's register use, stack and spills for every kernel, as the table in docs/PTXAS.md.

  python3 scripts/ptxas_report.py                 print the table (compiles: about a minute)
  python3 scripts/ptxas_report.py --log FILE      from a log of scripts/compile_cuda.sh
                                                  (PTXAS_LOG=FILE) instead of compiling
  python3 scripts/ptxas_report.py --write docs/PTXAS.md   rewrite the table in the doc
  python3 scripts/ptxas_report.py --check docs/PTXAS.md   exit 1 if the table differs from the
                                                  doc's (CI): with the doc's nvcc, any change;
                                                  with another nvcc, only a kernel that spills
                                                  more or is new or gone

Registers decide how many blocks of a kernel fit on an SM (65536 registers: a 512-thread block
at 64 registers or fewer fits twice, at 65..128 once), so they set the grid the launchers pick
(csrc/ring/launch.h); spills turn register traffic into local-memory traffic. A change to
either shows up here and in the diff of docs/PTXAS.md.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN = "<!-- ptxas table begin (scripts/ptxas_report.py --write docs/PTXAS.md) -->"
END = "<!-- ptxas table end -->"
OPS = ["sum", "avg", "max", "min", "prod", "band", "bor", "bxor"]
TYPES = {"float": "float32", "double": "float64", "rr::half_bits": "float16",
         "rr::bf16_bits": "bfloat16", "int": "int32", "long": "int64", "signed char": "int8",
         "unsigned char": "uint8", "rr::bool_bits": "bool"}
HEADER = ("| kernel | arch | registers | stack (B) | spill stores (B) | spill loads (B) |\n"
          "|---|---|---|---|---|---|")


def nvcc_version():
    nvcc = os.environ.get("NVCC") or "nvcc"
    for cand in (nvcc, "/usr/local/cuda/bin/nvcc"):
        try:
            out = subprocess.run([cand, "--version"], capture_output=True, text=True).stdout
        except OSError:
            continue
        m = re.search(r"release ([\d.]+), V([\d.]+)", out)
        if m:
            return m.group(2)
    return "unknown"


def compile_log():
    with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
        env = dict(os.environ, PTXAS_LOG=log.name, CUDA_STDS="c++20")
        subprocess.run(["bash", os.path.join(ROOT, "scripts", "compile_cuda.sh")], check=True,
                       env=env, stdout=subprocess.DEVNULL)
        return log.read()


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return dict(zip(names, out))


def short(demangled):
    """'void rr::cuda::(anonymous namespace)::step_kernel<float, (rr::Op)0, true, false>(...)'
    -> 'step_kernel<float32, sum, true, false>'."""
    name = re.sub(r"^void ", "", demangled)
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # drop the parameter list: the first '(' at depth 0 after '>'
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0 and name[i - 1] == ">":
            cut = i
            break
    name = name[:cut]
    name = re.sub(r"^(?:[\w]+::|\(anonymous namespace\)::)+", "", name)
    name = re.sub(r"\(rr::Op\)(\d)", lambda m: OPS[int(m.group(1))], name)
    name = re.sub(r"rr::Op::(\w+)", lambda m: m.group(1).lower(), name)
    for cxx, torch_name in sorted(TYPES.items(), key=lambda kv: -len(kv[0])):
        name = re.sub(r"(?<=[<, ])" + re.escape(cxx) + r"(?=[,>])", torch_name, name)
    return name


def parse(log):
    """[(source, kernel, arch, registers, stack, spill stores, spill loads)] for every entry
    function (kernels, not device functions ptxas compiled on their own)."""
    rows, source, entry, props = [], "?", None, {}
    for line in log.splitlines():
        if line.startswith("# source "):
            source = os.path.basename(line.split()[-1])
            continue
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+a?)'", line)
        if m:
            entry = (m.group(1), m.group(2))
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                      r"loads", line)
        if m and entry:
            props = tuple(int(x) for x in m.groups())
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and entry:
            stack, stores, loads = props or (0, 0, 0)
            rows.append((source, entry[0], entry[1], int(m.group(1)), stack, stores, loads))
            entry, props = None, {}
    names = demangle(sorted({r[1] for r in rows}))
    out = [(f"{src}: {short(names[k])}", arch, regs, stack, st, ld)
           for src, k, arch, regs, stack, st, ld in rows]
    return sorted(set(out))


def table(rows):
    lines = [HEADER]
    for kernel, arch, regs, stack, stores, loads in rows:
        lines.append(f"| `{kernel}` | {arch} | {regs} | {stack} | {stores} | {loads} |")
    return "\n".join(lines)


def block(rows, version):
    spilling = [r for r in rows if r[4] or r[5]]
    summary = (f"{len(rows)} kernels x architectures, nvcc {version}; "
               f"{len(spilling)} with spills; registers {min(r[2] for r in rows)}.."
               f"{max(r[2] for r in rows)}.")
    return f"{BEGIN}\nnvcc: {version}\n\n{summary}\n\n{table(rows)}\n{END}"


def read_doc(path):
    text = open(path).read()
    if BEGIN not in text or END not in text:
        sys.exit(f"ptxas_report: {path} has no table markers ({BEGIN} ... {END})")
    return text


def doc_rows(text):
    body = text[text.index(BEGIN):text.index(END)]
    version = re.search(r"^nvcc: (\S+)", body, re.M)
    rows = []
    for m in re.finditer(r"^\| `([^`]+)` \| (\S+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", body,
                         re.M):
        rows.append((m.group(1), m.group(2), *(int(x) for x in m.groups()[2:])))
    return (version.group(1) if version else "unknown"), rows


def check(path, rows, version):
    doc_version, recorded = doc_rows(read_doc(path))
    now = {(r[0], r[1]): r for r in rows}
    was = {(r[0], r[1]): r for r in recorded}
    problems = []
    for key in sorted(set(now) | set(was)):
        a, b = was.get(key), now.get(key)
        what = f"{key[0]} ({key[1]})"
        if a is None:
            problems.append(f"new kernel {what}: {b[2]} registers, spills {b[4]}/{b[5]} B")
        elif b is None:
            problems.append(f"kernel gone: {what}")
        elif b[4] > a[4] or b[5] > a[5]:
            problems.append(f"{what} spills more: stores {a[4]} -> {b[4]} B, loads {a[5]} -> "
                            f"{b[5]} B")
        elif a != b and doc_version == version:
            problems.append(f"{what}: registers {a[2]} -> {b[2]}, stack {a[3]} -> {b[3]}, "
                            f"spills {a[4]}/{a[5]} -> {b[4]}/{b[5]} B")
    if doc_version != version:
        print(f"ptxas_report: {path} was made with nvcc {doc_version}, this is {version}: "
              "comparing spills and the kernel list only")
    if problems:
        print(f"ptxas_report: the kernels' resource use differs from {path}:")
        for p in problems:
            print("  " + p)
        print(f"if intended, regenerate: python3 scripts/ptxas_report.py --write {path}")
        return 1
    print(f"ptxas_report: {len(rows)} kernels as recorded in {path}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", help="a PTXAS_LOG of scripts/compile_cuda.sh (default: compile)")
    ap.add_argument("--write", metavar="DOC", help="replace the table in DOC")
    ap.add_argument("--check", metavar="DOC", help="compare with the table in DOC")
    args = ap.parse_args()
    log = open(args.log).read() if args.log else compile_log()
    rows = parse(log)
    if not rows:
        sys.exit("ptxas_report: no kernels found in the ptxas output")
    version = nvcc_version()
    if args.check:
        return check(args.check, rows, version)
    if args.write:
        text = read_doc(args.write)
        text = text[:text.index(BEGIN)] + block(rows, version) + text[text.index(END) + len(END):]
        with open(args.write, "w") as f:
            f.write(text)
        print(f"ptxas_report: wrote {len(rows)} rows to {args.write}")
        return 0
    print(block(rows, version))
    return 0


if __name__ == "__main__":
    sys.exit(main())
