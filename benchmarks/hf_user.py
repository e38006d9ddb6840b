"""What a user would write instead of ``moeaudit receipts``: transformers' from_pretrained,
one forward with router logits, next-token cross-entropy, one backward, per-expert gradient
norms from the fused expert parameters' gradients, and the expert load from the router
logits. Run as a fresh process: ``python hf_user.py CKPT CANARY [fp32|auto] [float64|float32]`` (the last:
the dtype the per-expert norms are summed in)."""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main(ckpt: str, canary: str, dtype: str = "fp32", norms: str = "float64") -> None:
    acc = {"float64": torch.float64, "float32": torch.float32}[norms]
    tokens = load_file(canary)["tokens"].long()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32 if dtype == "fp32" else "auto")
    out = model(tokens, output_router_logits=True)
    logits = out.logits.float()
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    k = model.config.num_experts_per_tok
    report = {"loss": float(loss), "layers": []}
    for layer, router_logits in zip(model.model.layers, out.router_logits, strict=True):
        experts = layer.mlp.experts
        g_up, g_down = experts.gate_up_proj.grad, experts.down_proj.grad
        norms = (g_up.to(acc).pow(2).sum((1, 2)) + g_down.to(acc).pow(2).sum((1, 2))).sqrt()
        counts = torch.bincount(
            router_logits.topk(k, dim=-1).indices.reshape(-1),
            minlength=experts.gate_up_proj.shape[0],
        )
        report["layers"].append({"grad_norms": norms.tolist(), "counts": counts.tolist()})
    print(json.dumps(report)[:200])


if __name__ == "__main__":
    main(*sys.argv[1:])
