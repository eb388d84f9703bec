"""A fake engine reading our export (none_or_ok)."""
