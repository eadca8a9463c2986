"""Failure detection and classification: pure functions of evidence and a clock."""
