"""Deterministic simulation: the real client, bookie and metadata code in a seeded fake world.

Home of the simulated twins (a virtual-time event loop, network, disk behind the bookie's file
and thread seams, the clock of :mod:`bookkeeper_aio.common.clock`) and of the seeded runs that
use them. The in-memory metadata twin is :mod:`metadata.memory`; it passes the etcd driver's
contract tests (tests/integration/metadata).
"""
