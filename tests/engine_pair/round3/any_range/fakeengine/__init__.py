"""A fake engine reading our export (any_range)."""
