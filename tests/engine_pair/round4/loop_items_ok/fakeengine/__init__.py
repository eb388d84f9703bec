"""A fake engine reading our export and options (loop_items_ok)."""
