"""A fake engine reading our export (all_even)."""
