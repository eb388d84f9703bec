"""The CPU worker: everything from the accelerator worker but the device set-up."""

from .gpu_worker import Worker


class CPUWorker(Worker):
    def init_device(self) -> None:
        self.device = "cpu"
