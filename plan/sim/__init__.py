"""Trace-driven cluster simulator: replay failure traces against the real planner (pure, no I/O).

``trace`` makes and loads failure traces, ``policies`` holds the handling policies
(``unicorn``, ``megatron``, ``per-task`` and the static baselines) as pure decision
functions, ``engine`` replays a trace under one policy and charges detection,
transition and sub-healthy operation (Unicron Eq. 1), ``report`` compares policies.
"""
