"""The ``unmask`` console script and ``python -m unmask``.

Kept free of heavy imports: the command line imports torch and transformers, which takes
seconds, and a Ctrl-C during those imports must end like one during a command, with
``interrupted`` on one line and exit status 130, not a traceback.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Run the ``unmask`` command line; exit 130 with one line on Ctrl-C at any moment."""
    try:
        from unmask.cli import main as cli_main

        cli_main(argv)
    except KeyboardInterrupt:
        try:
            print("interrupted", file=sys.stderr)
        finally:
            raise SystemExit(130) from None


if __name__ == "__main__":
    main()
