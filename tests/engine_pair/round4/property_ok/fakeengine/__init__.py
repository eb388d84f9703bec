"""A fake engine reading our export and options (property_ok)."""
