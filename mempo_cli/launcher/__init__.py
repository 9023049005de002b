"""Running the whole system on one machine: ``mempo up`` and ``mempo eval``."""
