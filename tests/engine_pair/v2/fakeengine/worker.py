"""Worker (v2): a CUDA-only memory query, unguarded."""

import torch


class Worker:
    def determine_available_memory(self) -> int:
        free, _total = torch.cuda.mem_get_info()
        return free
