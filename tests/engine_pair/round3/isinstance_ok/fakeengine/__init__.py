"""A fake engine reading our export (isinstance_ok)."""
