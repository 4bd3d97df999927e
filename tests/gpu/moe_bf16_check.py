# HF transformers' own bf16 forward of qwen3moe-tiny / mixtral-tiny against the fp32 golden,
# per position of the all_logits prompt: a routing near-tie shows as one bad position.
import json, os, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM
root = os.environ.get("SPECD_FIXTURES", "../shared/fixtures")
for name in ("qwen3moe-tiny", "mixtral-tiny"):
    d = os.path.join(root, "models", name)
    g = json.load(open(os.path.join(d, "golden.json")))
    m16 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    for p in g["prompts"]:
        if "all_logits" not in p: continue
        with torch.no_grad():
            lg = m16(torch.tensor([p["prompt"]], device="cuda")).logits[0].float().cpu().numpy()
        ref = np.asarray(p["all_logits"], dtype=np.float32)
        errs = np.max(np.abs(lg - ref), axis=1) / np.max(np.abs(ref), axis=1)
        print(name, "HF bf16 vs fp32 golden, all positions of the", len(p["prompt"]), "token prompt: max",
              f"{errs.max():.3e} at position {int(errs.argmax())};", "positions over 3e-2:",
              [int(i) for i in np.nonzero(errs > 3e-2)[0]])
