"""Autorecovery: the auditor (one elected through etcd) and the replication workers.

A process of its own beside the bookies, never inside :mod:`bookie`: it finds the fragments of
lost or decommissioned bookies, marks their ledgers under-replicated in metadata, and workers
re-replicate each fragment with the client's one replication primitive (the same code the writer's
ensemble change and recovery write-back use). Floor 4 (docs/internals.md): client and metadata only.
"""
