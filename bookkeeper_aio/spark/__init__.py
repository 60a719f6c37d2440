"""The PySpark data source and sink ``bookkeeper`` (optional extra ``bookkeeper-aio[spark]``).

Floor 4 (docs/internals.md), and stricter: it uses only the public client API, the names
:mod:`bookkeeper_aio` re-exports (and the log API once it is public), so that what Spark users
get is what every application gets. ``make lint`` holds it to that.
"""
