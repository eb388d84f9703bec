"""A fake engine reading our export and options (const_expr)."""
