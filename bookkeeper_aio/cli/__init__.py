"""The ``bkaio`` command: a sandbox cluster and shell commands for operators."""
