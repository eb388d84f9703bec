"""A plugin package calling the engine the way hs-connectors does (issue 37 item 7)."""
