"""TODO: filled in by its module."""
