"""Worker (v1): the memory query is device-agnostic."""

import torch


class Worker:
    def determine_available_memory(self) -> int:
        if torch.cuda.is_available():
            return torch.cuda.mem_get_info()[0]
        return 1 << 30
