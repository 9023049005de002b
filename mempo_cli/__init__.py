"""The ``mempo`` command line and the launcher: above the services, which it starts and
drives (``mempo up``, ``mempo eval``, ``mempo sft``, each service's own commands), and
above the core (``mempo``) and the local stand-ins (``mempo_sim``) it uses. Nothing
imports it but the entry point, the benchmarks and the tests."""
