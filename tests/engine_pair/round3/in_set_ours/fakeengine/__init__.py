"""A fake engine reading our export (in_set_ours)."""
