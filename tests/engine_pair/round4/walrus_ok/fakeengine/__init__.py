"""A fake engine reading our export and options (walrus_ok)."""
