"""The base every worker class derives from: what a worker must provide, none of it done here."""

from abc import ABC, abstractmethod


class WorkerBase(ABC):
    def __init__(self, rank: int = 0):
        self.rank = rank

    def get_model(self):
        """The model this worker runs."""
        raise NotImplementedError

    @abstractmethod
    def load_model(self) -> None: ...

    def shutdown(self) -> None:
        """Nothing to release by default (a method that does nothing is not a stub)."""
        self.rank = -1
