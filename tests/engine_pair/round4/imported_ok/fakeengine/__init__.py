"""A fake engine reading our export and options (imported_ok)."""
