"""``python -m ringreduce.train``: see ringreduce/train/cli.py."""
import sys

from .cli import main

sys.exit(main())
