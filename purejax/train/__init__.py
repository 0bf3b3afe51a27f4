"""Training programs, each run as `python -m purejax.train.<name>`."""
