"""``python -m mempo_cli`` is the ``mempo`` command."""

from mempo_cli.main import main

main()
