"""A fake engine reading our export (not_size)."""
