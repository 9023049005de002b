"""HTTP request and response models of every service (docs/architecture.md, 'HTTP routes')."""
