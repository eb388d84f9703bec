"""A fake engine reading our export (engine_state)."""
