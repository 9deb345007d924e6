"""The ``unmask`` command line (filled in by the Foundation work)."""


def main() -> None:  # pragma: no cover - replaced by the real CLI
    raise SystemExit("unmask CLI not built yet")
