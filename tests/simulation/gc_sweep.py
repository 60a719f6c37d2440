"""The profiles with bookie GC on: each bookie runs garbage collection against the world's metadata
(the production :class:`bookie.gc.MetadataCatalog`, also its key checks and limbo's), with every
step as eager as it goes: a pass every half second, no grace for deleted or over-replicated
ledgers, every segment compacted and the current one rolled as soon as one byte of it is dead.
The invariants stay those of the profile underneath (tests/simulation/invariants.py): GC must never
take an acknowledged entry away, nor leave a bookie unable to start.

``run_seed(seed, profile=GC_PROFILES["race"])``; sweeps: tests/simulation/test_gc_seeds.py. The
other profiles' bookies keep GC off (``gc_interval_s`` an hour, no metadata), so their traces do
not change. A first version of these sweeps (1,600 seeds over the three profiles) found a fresh
journal's segment header left undurable when its first fdatasync failed (race seed 207;
tests/simulation/test_replay_durability.py pins it); this one found the rot invariant taking an
entry's new copy at the same offset of a later segment for its rotten one (race seed 1020).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

from bookie.config import BookieConfig
from bookie.cookie import COOKIE_FILE, LAYOUT_VERSION, read_cluster_binding
from bookie.gc import MetadataCatalog
from metadata.cluster import init_cluster
from tests.simulation.autorecovery import AutorecoveryScenario
from tests.simulation.race import RaceScenario
from tests.simulation.scenario import Scenario
from tests.simulation.world import ROOT, SimBookie, SimMetadata, World

GC_SETTINGS: dict[str, Any] = {
    "gc_interval_s": 0.5,
    "gc_deleted_ledger_grace_s": 0.0,
    "gc_over_replicated_interval_s": 0.5,
    "compaction_threshold": 1.0,
    "compaction_roll_dead_bytes": 1,
    "compaction_rate_bytes_per_s": 64 * 1024 * 1024,
}


def cluster_id(world: World) -> str:
    return f"sim-{world.seed}"


class GcBookie(SimBookie):
    """A simulated bookie with GC on, against the world's metadata."""

    def config(self) -> BookieConfig:
        return dataclasses.replace(super().config(), **GC_SETTINGS)

    def server_options(self) -> dict[str, Any]:
        """The catalog, reading the cluster the data dir's COOKIE names, as ``bookie/__main__.py``
        builds it. Without registration (the general and race profiles) nothing would name one: a
        fresh disk is formatted first with a COOKIE naming the world's cluster, as the first
        registration would (and a deterministic instance id, as ``SimBookie._registration``)."""
        fileio = self.fileio
        assert fileio is not None
        data_dir = f"/{self.name}"
        cookie = os.path.join(data_dir, COOKIE_FILE)
        if not self.world.bookies_register and not fileio.exists(cookie):
            fileio.makedirs(data_dir)
            body = {
                "bookie_id": self.name,
                "instance_id": f"{self.name}-1",
                "layout_version": LAYOUT_VERSION,
                "cluster_instance_id": cluster_id(self.world),
            }
            fileio.write_file_atomic(cookie, json.dumps(body, sort_keys=True).encode())
        catalog = MetadataCatalog(
            f"memory://{ROOT}",
            connect=functools.partial(_connect, self.world, self.name),
            cluster_id=functools.partial(read_cluster_binding, fileio, data_dir),
        )
        return {"catalog": catalog, "replicas": catalog}


def _connect(world: World, node: str, url: str) -> SimMetadata:
    return SimMetadata(world, node)


def with_gc(profile: type[Scenario]) -> type[Scenario]:
    """``profile`` with :class:`GcBookie` bookies and an initialised cluster."""

    class GcScenario(profile):  # type: ignore[valid-type,misc]
        def __init__(self, world: World) -> None:
            super().__init__(world)
            world.bookie_class = GcBookie

        def describe(self) -> str:
            return f"{super().describe()} bookie_gc=on"

        async def run(self) -> None:
            if not self.world.bookies_register:  # a registering profile initialises its own
                await init_cluster(self.world.store, ROOT, instance_id=cluster_id(self.world))
            await super().run()

    GcScenario.__name__ = GcScenario.__qualname__ = f"Gc{profile.__name__}"
    return GcScenario


GC_PROFILES: dict[str, type[Scenario]] = {
    "general": with_gc(Scenario),
    "race": with_gc(RaceScenario),
    "autorecovery": with_gc(AutorecoveryScenario),
}
