"""The accelerator worker: `get_model` is now called `fetch_model` here, and here only."""

from .worker_base import WorkerBase


class Worker(WorkerBase):
    def load_model(self) -> None:
        self.model = object()

    def fetch_model(self):
        return self.model
