"""Model runner (v2): holds a model built by name, of no class the source states."""

from fakeengine.models import build_model


class Runner:
    def __init__(self, arch: str = "tiny"):
        self.arch = arch
        self.model = None

    def load(self):
        self.model = build_model(self.arch)
