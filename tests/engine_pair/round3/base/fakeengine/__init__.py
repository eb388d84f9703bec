"""A fake engine reading our export (base)."""
