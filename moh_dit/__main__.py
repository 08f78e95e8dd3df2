"""``python -m moh_dit`` is the ``moh-dit`` command."""

from moh_dit.commands import main

main()
