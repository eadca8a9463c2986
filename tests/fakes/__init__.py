"""Fakes shared by the tests: :mod:`tests.fakes.slurm` is the one fake Slurm."""
