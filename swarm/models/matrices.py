"""Which of a stage's parameters are its hidden blocks' weight matrices: what `optimizer.name: muon`
trains with Muon (the rest trains with AdamW, swarm.engine.muon).

A stage may say so itself with `hidden_blocks`, the names of its submodules that hold the hidden
blocks (a transformers decoder's stage: its layers); every trainable parameter of >= 2 dimensions
in them is a matrix (LoRA's adapters included). Otherwise a default that fits a plain stack: every
trainable parameter of >= 2 dimensions except embeddings, the model's first weight (its input
layer, in stage 0) and its last (the output head, in the last stage), and parameters tied across
stages (an input embedding reused as the head).
"""

from __future__ import annotations

from torch import nn

from swarm.models.base import StagedModel


def hidden_matrices(staged: StagedModel, index: int) -> set[int]:
    """The ids of stage `index`'s Muon matrices."""
    stage = staged.stages[index]
    blocks = getattr(stage, "hidden_blocks", None)
    if blocks is not None:
        return {
            id(p) for name in blocks for p in stage.get_submodule(name).parameters() if p.requires_grad and p.ndim >= 2
        }
    tied = {name for pair in staged.tied for i, name in (pair.first, pair.second) if i == index}
    embeddings = {
        id(p) for m in stage.modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag) for p in m.parameters()
    }
    weights = [(name, p) for name, p in stage.named_parameters() if p.requires_grad and p.ndim >= 2]
    ends = set()
    if weights and index == 0:
        ends.add(weights[0][0])
    if weights and index == len(staged.stages) - 1:
        ends.add(weights[-1][0])
    return {id(p) for name, p in weights if name not in tied | ends and id(p) not in embeddings}
