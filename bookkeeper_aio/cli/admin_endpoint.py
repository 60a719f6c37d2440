"""A bookie's admin endpoint as the CLI finds it and makes sure of it before acting on it
(``bkaio decommission`` makes the bookie read-only through it, ``bkaio bookie gc`` starts a pass).

A registration publishes the endpoint its bookie listens on (the ``admin`` attribute). By default
that is a loopback address: from another host it names *that* host's own bookie, if it runs one.
So an address found in a registration (or given) for a bookie id is used only after its ``/state``
answered with that bookie id; anything else is refused with what to do instead.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import metadata
from bookkeeper_aio.errors import BKInterfaceError

ADMIN_TIMEOUT_S = 5.0


async def registered_admin(meta: metadata.MetadataConnection, bookie_id: str) -> str | None:
    """The admin endpoint the bookie publishes in its registration (``admin`` attribute), if any;
    None too when the bookie is not registered (down)."""
    bookies = await metadata.list_bookies(meta.store, meta.root)
    info = bookies.writable.get(bookie_id) or bookies.readonly.get(bookie_id)
    return None if info is None else info.attributes.get("admin")


def serving_bookie(admin: str) -> str | None:
    """The bookie id the admin endpoint at ``admin`` answers for (blocking: run it in a thread).
    Raises OSError / ValueError when it does not answer."""
    with urllib.request.urlopen(f"http://{admin}/state", timeout=ADMIN_TIMEOUT_S) as answer:
        serving = json.loads(answer.read()).get("bookie_id")
    return None if serving is None else str(serving)


def check_admin_is(admin: str, bookie_id: str) -> None:
    """Refuse an admin endpoint that does not answer for ``bookie_id`` (blocking: run it in a
    thread). Raises BKInterfaceError naming both bookies and the way out."""
    try:
        serving = serving_bookie(admin)
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise BKInterfaceError(
            f"could not reach {bookie_id}'s admin endpoint http://{admin}/state: {error}; run this "
            f"on {bookie_id}'s host (its admin endpoint listens on loopback by default) or pass "
            "--admin HOST:PORT"
        ) from error
    if serving != bookie_id:
        raise BKInterfaceError(
            f"the admin endpoint {admin} belongs to bookie {serving!r}, not {bookie_id!r} (an admin "
            f"endpoint on loopback is reachable from its own host only): run this on {bookie_id}'s "
            "host, or pass --admin HOST:PORT of its admin endpoint"
        )
