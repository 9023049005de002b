"""Async HTTP clients of the services (retries: docs/contributing.md, 'Errors and retries')."""
