"""``unicorn-train``: the built-in trainer (issue "Training integration").

Not built yet: the entry point exists so packaging is fixed; it exits with status 2.
"""

from __future__ import annotations

import sys


def main() -> None:
    print("unicorn-train: not implemented yet (see README, 'What exists')", file=sys.stderr)
    sys.exit(2)
