"""Hierarchical checkpoint engine: host memory, peers, local disk, remote storage."""
