"""``python -m moh_dit`` is the ``moh-dit`` command."""

from moh_dit.cli import main

main()
