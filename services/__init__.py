"""MemPO services: one sub-package per deployable service; they share only mempo/."""
