"""A fake engine reading our export and options (module)."""
