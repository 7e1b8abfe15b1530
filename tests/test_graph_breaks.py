"""Graph breaks fxremat removes before Dynamo traces (fxremat/graph_breaks.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# fxremat is imported before transformers, and Dynamo reset between: the graphs must depend on neither. HF GPT-2 names no
# loss_type, so its forward calls transformers' logger.warning_once, where Dynamo broke the graph in two:
# the LM head in one graph, its loss in the next.
SCRIPT = textwrap.dedent(
    """
    import json, torch, fxremat
    torch._dynamo.reset()  # keeps what fxremat set up: the graphs do not depend on it
    from transformers import GPT2Config, GPT2LMHeadModel
    import transformers.utils.logging as hf_logging
    assert type(hf_logging.__loader__).__name__ == "SourceFileLoader", hf_logging.__loader__

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    assert getattr(model, "loss_type", None) is None
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend="fxremat", options={"inner": "eager"})
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    error = max(float((p.grad - want[n]).abs().max()) for n, p in model.named_parameters())
    print(json.dumps({"plans": len(fxremat.plans()), "error": error}))
    """
)


def test_an_hf_model_that_warns_inside_its_forward_is_one_graph_whatever_the_import_order():
    # Run alone: in this process transformers and fxremat are imported already.
    env = dict(os.environ, FXREMAT_PLAN_CACHE="0", PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["plans"] == 1, result  # two before: the head and the loss in separate graphs
    assert result["error"] < 1e-5, result
