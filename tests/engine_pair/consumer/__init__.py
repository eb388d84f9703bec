"""A package that calls the fake engine the way speculators 0.3.0 calls vLLM (for `doctor --scan`).

Written against `v1/fakeengine`; against `v2` each module hits one kind of break (see the README).
"""
