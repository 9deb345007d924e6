"""``python -m unmask ...`` runs the ``unmask`` command line."""

from unmask.cli import main

main()
