"""A fake engine for doctor's method-binding checks (issue 37 item 7), shaped like vLLM's KV connectors."""
