"""A fake engine reading our export (chained)."""
