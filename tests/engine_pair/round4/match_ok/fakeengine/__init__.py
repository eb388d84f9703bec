"""A fake engine reading our export and options (match_ok)."""
