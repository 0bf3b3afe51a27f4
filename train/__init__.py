"""Training programs, each run as `python -m train.<name>`."""
