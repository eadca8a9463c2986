"""Hierarchical checkpoint engine: host memory, peers, local disk, remote storage.

Who calls what:

- the training rank: :class:`ckpt.snapshot.SnapshotWriter` (blocks only for the copy into
  shared memory), :class:`ckpt.jit.JitCheckpointer` (just-in-time snapshots),
  :class:`ckpt.restore.Restorer` (nearest verified copy), and, through
  ``torch.distributed.checkpoint``, :mod:`ckpt.dcp` (save at one layout, load at another,
  from memory);
- the node agent (everything asynchronous, so it survives a rank's crash):
  :func:`ckpt.shard.seal_shard` (checksums), :class:`ckpt.persist.Persister` (local disk
  and remote, retention), :mod:`ckpt.peer` (ring replication over TCP), both storing
  shards by the one commit protocol, :func:`ckpt.commit.commit_shard`;
  :func:`ckpt.jit.request_jit` / :func:`ckpt.jit.jit_responses`;
- the coordinator: :func:`ckpt.tier.latest_common` over what the agents report.

The on-storage format, the same in every tier, is described in :mod:`ckpt.format`.
"""
