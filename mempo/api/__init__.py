"""HTTP request and response models of every service: the routes of DESIGN.md section 6."""
