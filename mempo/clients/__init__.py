"""Async HTTP clients of the services (retries per STYLE.md rule 7)."""
