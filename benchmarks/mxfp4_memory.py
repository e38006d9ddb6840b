"""Peak memory and time of a replay of one gpt-oss model stored three ways: MXFP4 (the released
format, experts kept packed and dequantised one expert at a time), bf16 and fp32 (docs/benchmarks.md §1k).
Each replay is a fresh process (``ru_maxrss`` of the child), the three alternate round by round.

    python benchmarks/mxfp4_memory.py [--rounds 2]

The model is random, with the expert share of gpt-oss-20b (the routed experts are most of its
bytes): hidden 1024, 2 layers, 32 experts of width 1024, vocabulary 8192; canary 4×256.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from moeaudit.checkpoint import mxfp4

CHILD = """
import sys, time, torch
from moeaudit.checkpoint import Checkpoint
from moeaudit.replay import replay
tokens = torch.randint(0, 8192, (4, 256), generator=torch.Generator().manual_seed(1))
t0 = time.perf_counter()
r = replay(Checkpoint(sys.argv[1]), tokens)
print(r.nll, time.perf_counter() - t0)
"""


def build(root: Path) -> dict[str, Path]:
    config = transformers.AutoConfig.for_model(
        "gpt_oss",
        vocab_size=8192,
        hidden_size=1024,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        intermediate_size=1024,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    paths = {"fp32": root / "fp32", "bf16": root / "bf16", "mxfp4": root / "mxfp4"}
    model.save_pretrained(paths["fp32"])
    model.to(torch.bfloat16).save_pretrained(paths["bf16"])
    tensors = load_file(str(paths["bf16"] / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[key + "_blocks"], packed[key + "_scales"] = mxfp4.quantize(t.float())
        else:
            packed[key] = t
    paths["mxfp4"].mkdir()
    save_file(packed, str(paths["mxfp4"] / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((paths["bf16"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (paths["mxfp4"] / "config.json").write_text(json.dumps(cfg))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(Path(tmp))
        sizes = {k: sum(f.stat().st_size for f in p.iterdir()) / 2**20 for k, p in paths.items()}
        results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in paths}
        for r in range(args.rounds):
            # children's ru_maxrss only grows: measure each store in its own python -c wrapper
            for name in ("mxfp4", "bf16", "fp32") if r % 2 == 0 else ("fp32", "bf16", "mxfp4"):
                measure = (
                    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
                    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
                )
                wrapper = subprocess.run(
                    [sys.executable, "-c", measure, sys.executable, "-c", CHILD, str(paths[name])],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                lines = wrapper.stdout.split("\n")
                nll, seconds = (float(x) for x in lines[0].split())
                peak_mb = int(lines[1]) / 1024
                results[name].append((peak_mb, seconds, nll))
                print(f"  round {r + 1} {name:6s} peak {peak_mb:7.0f} MB  {seconds:6.2f} s  nll {nll:.6f}", flush=True)
    print("\n| store | files MB | peak RSS MB (median) | replay s (median) | NLL |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        print(
            f"| {name} | {sizes[name]:.0f} | {statistics.median(r[0] for r in rows):.0f} | "
            f"{statistics.median(r[1] for r in rows):.2f} | {rows[0][2]:.6f} |"
        )


if __name__ == "__main__":
    main()
