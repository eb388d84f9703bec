"""The engine's environment variables, read when asked (vLLM's `envs.py` shape)."""

import os

environment_variables = {
    "FAKE_STRICT_LAYERS": lambda: bool(int(os.getenv("FAKE_STRICT_LAYERS", "0"))),
}


def __getattr__(name: str):
    return environment_variables[name]()
