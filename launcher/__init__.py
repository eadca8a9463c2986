"""Compute-node side: the node agent (``unicorn-agent``) and the built-in trainer (``unicorn-train``)."""
