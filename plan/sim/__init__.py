"""Trace-driven cluster simulator: replay failure traces against the real planner (pure, no I/O).

``trace`` makes and loads failure traces; ``costs`` holds what recovery costs each system
(our measured figures from BENCHMARKS.md, and the papers' own); ``systems`` the
throughput of a task under each system (Megatron at a fixed TP/PP, Varuna, Oobleck,
Bamboo) on the planner's performance model; ``policies`` the handling policies
(``unicorn``, ``megatron``, ``per-task`` and the static baselines) and ``elastic`` the
single-job fault-tolerant systems (``oobleck``, ``varuna``, ``bamboo``), all as pure
decision functions; ``engine`` replays a trace under one policy and charges steady-state,
detection, transition and sub-healthy losses against the ideal (Unicron Eq. 1);
``report`` compares policies.
"""
