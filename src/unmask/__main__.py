"""``python -m unmask ...`` runs the ``unmask`` command line."""

from unmask.entry import main

main()
