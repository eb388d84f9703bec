"""A fake engine reading our export (or_over)."""
