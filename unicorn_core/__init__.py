"""Shared kernel: wire protocol, Redis key names, configuration, errors, logging, Slurm adapter.

Imported by every other package and importing none of them, so code on compute nodes
(``launcher``, ``ckpt``) never pulls in the coordinator (``unicornd``).
"""
