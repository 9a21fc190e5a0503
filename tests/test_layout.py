"""The package's layout: `import ringreduce` is the library alone, without the trainer."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ringreduce.train (trainer, data, models, NCCL comparisons, progress bars) and what only it
# would import. torch itself may import tqdm (torch.hub does where it is installed), so only
# the modules `import ringreduce` adds to those of `import torch` count.
NOT_WITH_THE_LIBRARY = ("ringreduce.train", "tqdm", "torchvision")

ADDED_BY_IMPORT = """
import sys
import torch, torch.distributed
before = set(sys.modules)
import ringreduce
banned = {banned!r}
print(sorted(m for m in set(sys.modules) - before
             if any(m == b or m.startswith(b + ".") for b in banned)))
"""


def test_import_ringreduce_loads_none_of_the_trainer():
    code = ADDED_BY_IMPORT.format(banned=NOT_WITH_THE_LIBRARY)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", ("`import ringreduce` must not load the trainer: "
                                         + proc.stdout)
