"""Builds the engine by hand: constructors and keyword arguments."""

from fakeengine.config import SchedulerConfig
from fakeengine.core import Scheduler
from fakeengine.entrypoints import LLM

from .compat import *  # noqa: F403


class Generator:
    def __init__(self, model: str):
        self.llm = LLM(model, dtype="auto", kv_cache_specs={"full": 16})
        self.config = SchedulerConfig(max_num_seqs=8)
        self.scheduler = Scheduler(self.config)

    def request(self, ids: list[int]):
        return Request("req-0", ids, eos_token_id=2)  # noqa: F405

    def status(self):
        replies = self.llm.collective_rpc("status")
        return replies[0].state
