"""The scorer service."""
