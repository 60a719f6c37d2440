"""The ``bkaio`` command: a sandbox cluster and shell commands for operators."""


def run() -> None:
    """The ``bkaio`` script: :func:`bookkeeper_aio.cli.main.main`, whose imports (gRPC, etcd, the
    client) take a second or more on a busy machine; Ctrl-C meanwhile ends it with 130, as later,
    not with a traceback of the import it interrupted."""
    try:
        from bookkeeper_aio.cli.main import main
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    raise SystemExit(main())
