"""Hierarchical checkpoint engine: host memory, peers, local disk, remote storage.

Who calls what:

- the training rank: :class:`ckpt.snapshot.SnapshotWriter` (blocks only for the copy into
  shared memory), :class:`ckpt.jit.JitCheckpointer` (just-in-time snapshots),
  :class:`ckpt.restore.Restorer` (nearest verified copy), and, through
  ``torch.distributed.checkpoint``, :mod:`ckpt.dcp` (save at one layout, load at another,
  from memory);
- the node agent (everything asynchronous, so it survives a rank's crash):
  :func:`ckpt.shard.seal_shard` (checksums), :class:`ckpt.persist.Persister` (local disk
  and remote, commit protocol, retention), :mod:`ckpt.peer` (ring replication over TCP),
  :func:`ckpt.jit.request_jit` / :func:`ckpt.jit.jit_responses`;
- the coordinator: :func:`ckpt.tier.latest_common` over what the agents report.

The on-storage format, the same in every tier, is described in :mod:`ckpt.format`.
"""
