"""A fake engine reading our export (ifexp)."""
