"""``unicorn-agent``: the per-node agent (issue "Node agent and in-band error detection").

Not built yet: the entry point exists so packaging and the layering are fixed; it exits
with status 2 and says so rather than pretending to supervise anything.
"""

from __future__ import annotations

import sys


def main() -> None:
    print("unicorn-agent: not implemented yet (see README, 'What exists')", file=sys.stderr)
    sys.exit(2)
