"""A fake engine reading our export (get_default)."""
