"""A fake engine reading our export and options (envs_ok)."""
