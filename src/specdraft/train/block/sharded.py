"""One module call per step around the DFlash draft, and `--fsdp`: its trainable weights sharded by FSDP2.

`BlockModel` computes a batch's summed block losses (or its validation stats) in one `forward`, so under
`torch.distributed.fsdp.fully_shard` every rank makes the same collectives whatever its samples: one
all-gather of the weights in the step's forward (kept gathered, `reshard_after_forward=False`, for the
chunks' recomputation in backward) and one reduce-scatter of the gradients at the end of backward, summed
over ranks (divide factor 1: the loss is already divided by the global batch's loss weight). A rank
without samples runs the same call on an empty batch; the loss carries 0 x every trainable weight, so each
gets a gradient on every rank.

Sharded: every trainable parameter of the draft (fc, hidden_norm, the layers, norm, and the mask embedding
when trained), each dim-0 sharded over the ranks, with AdamW's moments. Not sharded: the frozen target
embedding and LM head rows (`ignored_params`: every rank holds them whole) and the buffers (d2t, t2d).

Checkpoints stay in the format of one process: `full_states` gathers the full draft and the optimizer state
(keyed as `torch.optim.Optimizer.state_dict` keys it: the index of each trainable parameter), so a
checkpoint written under --fsdp resumes with or without it, and final/ is the same files.
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.model.dflash import DFlashDraft
from specdraft.train.block.objective import Objective, batch_loss, evaluate


class BlockModel(nn.Module):
    """The draft behind one call per step: the batch's summed loss and stats, or validation stats."""

    def __init__(self, draft: DFlashDraft, obj: Objective | None = None):
        super().__init__()
        self.draft = draft
        # the slot loss: weights, --loss terms and the frozen teacher head, on the draft's device already (not a
        # submodule: out of the state dicts, checkpoints and FSDP's reach)
        self.obj = obj or Objective()

    def forward(self, batch: list[tuple], anchors: list[torch.Tensor] | None, chunk: int, n_val: int = 0):
        """Training (`anchors` given): (summed loss + 0 x every trainable weight, stats). Validation
        (`anchors` None): (None, stats over every valid anchor up to n_val per sequence)."""
        if anchors is None:
            return None, evaluate(self.draft, batch, n_val, obj=self.obj)
        loss, st = batch_loss(self.draft, batch, anchors, chunk, self.obj)
        zero = sum(p.sum() for p in self.draft.parameters() if p.requires_grad) * 0.0
        return (zero if loss is None else loss + zero), st


def wrap(draft: DFlashDraft, sharded: bool, obj: Objective | None = None) -> BlockModel:
    """The draft in a `BlockModel`, its trainable weights sharded in place by FSDP2 when `sharded`."""
    model = BlockModel(draft, obj)
    if sharded:
        from torch.distributed.fsdp import fully_shard

        frozen = {p for p in model.parameters() if not p.requires_grad}
        fully_shard(model, reshard_after_forward=False, ignored_params=frozen)
        model.set_gradient_divide_factor(1.0)  # a sum over ranks, as one process sums over samples,
        model.set_force_sum_reduction_for_comms(True)  # as ReduceOp.SUM (gloo has no PREMUL_SUM)
    return model


def trainable_names(model: BlockModel) -> list[str]:
    """The trainable parameters' names, in the order of the optimizer's (its state's indices)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def full_states(model: BlockModel, opt: torch.optim.Optimizer, sharded: bool) -> tuple[DFlashDraft, dict]:
    """(the draft, the optimizer state) in one process's form; a collective when sharded (all ranks call;
    rank 0's are the full ones)."""
    if not sharded:
        return model.draft, opt.state_dict()
    from specdraft.train.checkpoint import _full_states

    weights, osd = _full_states(model, opt, True)
    draft = DFlashDraft(model.draft.cfg)
    if weights:  # rank 0 (the others get nothing back)
        draft.load_state_dict({k.removeprefix("draft."): v for k, v in weights.items()}, strict=True)
    index = {n: i for i, n in enumerate(trainable_names(model))}
    return draft, {"state": {index[n]: s for n, s in osd.get("state", {}).items()},
                   "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                    for g in osd.get("param_groups", [])]}  # fmt: skip


def load_optimizer(model: BlockModel, opt: torch.optim.Optimizer, state: dict, sharded: bool) -> None:
    """A saved optimizer state (one process's form) into this run's optimizer (each rank its shard)."""
    if not sharded:
        opt.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = trainable_names(model)
    osd = {"state": {names[i]: s for i, s in state["state"].items()},
           "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}  # fmt: skip
    set_optimizer_state_dict(model, opt, osd, options=StateDictOptions(full_state_dict=True))
