"""A fake engine reading our export and options (helper_guarded)."""
