"""``python -m oom_magic fit CHECKPOINT``: the fit check as a command (see oom_magic.cli)."""
import sys

from .cli import main

sys.exit(main())
