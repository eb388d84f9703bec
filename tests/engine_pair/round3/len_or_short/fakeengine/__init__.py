"""A fake engine reading our export (len_or_short)."""
