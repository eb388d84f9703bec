"""Re-exports the engine's request module with a star import (followed by `doctor --scan`)."""

from fakeengine.request import *  # noqa: F403
