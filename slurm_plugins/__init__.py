"""Slurm-side pieces of unicorn: SPANK plugin (C), job_submit.lua, HealthCheckProgram.

``install.py`` builds and places them for a cluster (standard library only, so
``scripts/dev-cluster`` can use it before any virtualenv exists).
"""
