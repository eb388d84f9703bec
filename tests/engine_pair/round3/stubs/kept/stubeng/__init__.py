"""A fake engine whose workers share an abstract base (issue 46, item 2)."""
