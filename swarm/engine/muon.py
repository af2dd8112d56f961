"""`optimizer.name: muon`: Muon on the hidden blocks' weight matrices, AdamW on everything else.

Muon (torch.optim.Muon: momentum, then the update orthogonalized by Newton-Schulz iterations) is
defined for 2-D matrices; a convolution's kernel is one too once flattened to [out, in*k*k], so
its update is computed on that view and lands in the parameter itself. Embeddings, the output
head, norms and biases are not matrices whose orthogonalized update makes sense (Jordan et al.,
modded-nanogpt; torch's documentation says the same), so they train with AdamW at its own
learning rate (`optimizer.adamw_lr`).

One optimizer, not two: the stage's step, its schedule (a LambdaLR over every group, each from its
own base rate), clipping, checkpoints, state copies and restores all handle one
`torch.optim.Optimizer` whose groups say which rule they follow (`kind`). Its AdamW part is torch's
AdamW working on the same group dicts and the same state, so nothing is kept twice.
"""

from __future__ import annotations

import torch

from swarm.config import OptimizerConfig

MUON, ADAMW = "muon", "adamw"


def muon_available() -> bool:
    return hasattr(torch.optim, "Muon")


class MuonAdamW(torch.optim.Optimizer):
    """Groups tagged `kind: muon` step with Muon on [out, -1] views; `kind: adamw` with AdamW."""

    def __init__(self, groups: list[dict], cfg: OptimizerConfig) -> None:
        if not muon_available():
            raise ValueError(
                f"optimizer.name: muon needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}"
            )
        defaults = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "kind": ADAMW}
        super().__init__(groups, defaults)
        # torch's own Muon rules per group (momentum, Nesterov, its Newton-Schulz coefficients and
        # the default shape-dependent rate), taken from a throwaway instance so they follow torch
        reference = torch.optim.Muon([torch.zeros(1, 1)], momentum=cfg.momentum)
        muon_rules = {k: v for k, v in reference.defaults.items() if k not in ("lr", "weight_decay")}
        for group in self.param_groups:
            if group["kind"] == MUON:
                for key, value in muon_rules.items():
                    group.setdefault(key, value)
        adamw_groups = [g for g in self.param_groups if g["kind"] == ADAMW]
        # AdamW shares the group dicts (its defaults fill in betas, eps, ...) and this state
        # (a stage of LoRA adapters alone has matrices only: AdamW then holds a placeholder group)
        self._adamw = torch.optim.AdamW(
            adamw_groups or [{"params": []}], lr=cfg.adamw_rate, betas=cfg.betas, eps=cfg.eps
        )
        self._share()

    def _share(self) -> None:
        """AdamW's groups and state are this optimizer's (again after a load, which makes new ones)."""
        self._adamw.param_groups = [g for g in self.param_groups if g["kind"] == ADAMW]
        self._adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == MUON:
                self._muon_group(group)
        self._adamw.step()
        return loss

    def _muon_group(self, group: dict) -> None:
        from torch.optim._muon import muon  # torch.optim.Muon's own update, on matrix views

        params, grads, buffers = [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            rows = p.shape[0]
            params.append(p.view(rows, -1))
            grads.append(p.grad.reshape(rows, -1))
            buffers.append(state["momentum_buffer"].view(rows, -1))
        if params:
            muon(
                params,
                grads,
                buffers,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                ns_coefficients=group["ns_coefficients"],
                eps=group["eps"],
                ns_steps=group["ns_steps"],
                adjust_lr_fn=group["adjust_lr_fn"],
                has_complex=False,
            )

    def load_state_dict(self, state_dict: dict) -> None:
        """A checkpoint of another split of parameters between Muon and AdamW is refused in one line
        (the states would land on the wrong rule silently)."""
        theirs = [g.get("kind", ADAMW) for g in state_dict["param_groups"]]
        ours = [g["kind"] for g in self.param_groups]
        if theirs != ours:
            raise ValueError(
                f"optimizer state: its groups follow {theirs}, this stage's {ours} (another optimizer or model?)"
            )
        super().load_state_dict(state_dict)
        self._share()


def muon_groups(cfg: OptimizerConfig, params: list[torch.nn.Parameter], matrices: set[int]) -> list[dict]:
    """The stage's trainable parameters as groups: Muon's matrices (by id) at `lr`; the rest at
    `adamw_lr`, decayed only where AdamW decays (>= 2-D), as `swarm.engine.optim`'s AdamW."""
    muon = [p for p in params if id(p) in matrices]
    rest = [p for p in params if id(p) not in matrices]
    groups = [
        {"params": muon, "kind": MUON, "lr": cfg.lr, "weight_decay": cfg.weight_decay},
        {
            "params": [p for p in rest if p.ndim >= 2],
            "kind": ADAMW,
            "lr": cfg.adamw_rate,
            "weight_decay": cfg.weight_decay,
        },
        {"params": [p for p in rest if p.ndim < 2], "kind": ADAMW, "lr": cfg.adamw_rate, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]] or [{"params": [], "kind": ADAMW}]
