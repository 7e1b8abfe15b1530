#!/usr/bin/env bash
# fxremat against what users pick today, on one CUDA GPU (the GPU twin of benchmarks/compare.py).
#
#   bash benchmarks/gpu_check.sh            # from anywhere; about 5-8 minutes on an H100/H200
#
# A GPT-2-style decoder in bf16 (plain PyTorch, no transformers needed), one training step
# (forward returning the loss, then backward) per row, each row in a fresh process:
#   eager, checkpoint (per-block torch.utils.checkpoint, non-reentrant), inductor (torch.compile
#   default), inductor_budget_0.5 / 0.0 (torch._functorch.config.activation_memory_budget),
#   fxremat with no budget (fastest plan), at its least peak (budget 1 B, on_infeasible="min"),
#   and at budgets in bytes: half of Inductor's measured peak, the checkpoint row's measured
#   peak, and midway between fxremat's fastest and least predicted peaks.
# Peak = torch.cuda.max_memory_allocated() during the step minus memory_allocated() before it
# (parameters, inputs and the .grad buffers of the warm-up step are in the baseline).
# Step time = median of REPS synchronised steps after warm-up.
#
# It installs nothing: torch must be there; fxremat is imported from this checkout (PYTHONPATH),
# after an optional `pip install --no-deps --no-build-isolation -e .` that may fail harmlessly.
# scipy is optional: without it fxremat's "auto" solver (min-cut + ILP) is replaced by "mincut".
# Every row has a timeout; a failing or timed-out row is marked and the run goes on; rows
# that would start within 30 s of the deadline (TOTAL_S) are marked "skipped". The markdown table is
# printed last, also when rows failed.
#
# Knobs (environment): PYTHON, TOTAL_S (400: every row ends by then), ROW_TIMEOUT (150),
# REPS (5), LAYERS (4), HIDDEN (1024), HEADS (16), SEQ (1024), BATCH (32), VOCAB (8192),
# KEEP_WORK=1 (keep the logs folder), GPU_CHECK_ALLOW_CPU=1 (smoke-test the logic on a CPU).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
export TOTAL_S="${TOTAL_S:-400}" ROW_TIMEOUT="${ROW_TIMEOUT:-150}" REPS="${REPS:-5}"
export LAYERS="${LAYERS:-4}" HIDDEN="${HIDDEN:-1024}" HEADS="${HEADS:-16}" SEQ="${SEQ:-1024}"
export BATCH="${BATCH:-32}" VOCAB="${VOCAB:-8192}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/fxremat-gpu-check.XXXXXX")"
export WORK
export TORCHINDUCTOR_CACHE_DIR="$WORK/inductor-cache"   # fresh kernel cache, shared by the rows
export TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0   # every row really compiles
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false
unset FXREMAT_BUDGET || true
cleanup() { if [[ "${KEEP_WORK:-0}" != 1 ]]; then rm -rf "$WORK"; else echo "logs kept in $WORK"; fi; }
trap cleanup EXIT

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
echo "nproc $(nproc)"
"$PY" - <<'EOF'
import os, sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"available {torch.cuda.is_available()}")
if not torch.cuda.is_available() and os.environ.get("GPU_CHECK_ALLOW_CPU") != "1":
    sys.exit("gpu_check.sh: CUDA is not available; this script measures a GPU (GPU_CHECK_ALLOW_CPU=1 to smoke-test)")
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
EOF

if ! "$PY" -c "import importlib.metadata as m; m.version('fxremat')" >/dev/null 2>&1; then
  echo "== pip install --no-deps --no-build-isolation -e . (optional; PYTHONPATH covers a failure)"
  if ! timeout 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$WORK/pip.log" 2>&1; then
    echo "   pip install failed; continuing with PYTHONPATH=$REPO. Its last lines:"
    tail -n 3 "$WORK/pip.log" || true
  fi
fi
"$PY" -c "import fxremat; print('fxremat', fxremat.__version__, 'from', fxremat.__file__)"

cat >"$WORK/bench.py" <<'EOF'
"""Rows (--row) and the driver of benchmarks/gpu_check.sh. Prints the markdown table last."""
import json, math, os, statistics, subprocess, sys, time, warnings

MIB = 2 ** 20
ENV = os.environ
WORK = ENV["WORK"]
RESULTS = os.path.join(WORK, "rows.jsonl")


# ---------------------------------------------------------------- the model
def build():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    L, H, NH, S, B, V = (int(ENV[k]) for k in ("LAYERS", "HIDDEN", "HEADS", "SEQ", "BATCH", "VOCAB"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
            self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
            self.fc, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

        def forward(self, x):
            b, s, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
            q, k, v = (t.view(b, s, NH, h // NH).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
            return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, H), nn.Embedding(S, H)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(H)
            self.checkpoint = False

        def forward(self, ids):
            x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False) if self.checkpoint else block(x)
            logits = self.ln_f(x) @ self.wte.weight.t()          # tied LM head
            return F.cross_entropy(logits[:, :-1].float().reshape(-1, V), ids[:, 1:].reshape(-1))

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = GPT().to(device=dev, dtype=torch.bfloat16)
    ids = torch.randint(0, V, (B, S), device=dev)
    desc = (f"GPT-2-style decoder, {L} layers, hidden {H}, {NH} heads, {S} tokens, batch {B}, vocabulary {V}, "
            f"bf16 weights and activations, fp32 loss, SDPA causal, per-block checkpoint for 'checkpoint'")
    return model, ids, desc


# ---------------------------------------------------------------- one row
def row(strategy, budget, on_infeasible):
    import torch
    import fxremat

    model, ids, desc = build()
    cuda = torch.cuda.is_available()
    out = dict(strategy=strategy, budget=budget, description=desc)
    fn = model
    if strategy == "checkpoint":
        model.checkpoint = True
    elif strategy.startswith("inductor"):
        if strategy.startswith("inductor_budget_"):
            torch._functorch.config.activation_memory_budget = float(strategy.rsplit("_", 1)[1])
        fn = torch.compile(model)
    elif strategy == "fxremat":
        opts = {} if budget is None else {"budget": budget, "on_infeasible": on_infeasible}
        try:
            import scipy.optimize  # noqa: F401  (the ILP half of solver="auto")
        except ImportError:
            opts["solver"] = "mincut"
            out["note"] = "scipy missing: solver=mincut"
        if cuda:
            name = torch.cuda.get_device_name(0).lower()
            for hw in ("h200", "h100", "a100"):
                if hw in name:
                    opts["hardware"] = hw
        fn = torch.compile(model, backend=fxremat.backend(**opts))
    elif strategy != "eager":
        raise ValueError(strategy)

    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        fn(ids).backward()

    t0 = time.perf_counter()
    loss = fn(ids)
    loss.backward()
    sync()
    out["first_call_s"] = time.perf_counter() - t0
    out["loss"] = float(loss.detach().float())
    out["grad_norm"] = float(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None) ** 0.5)
    del loss
    step()  # warm-up (the .grad buffers exist from the first call)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        sync()
        out["peak_bytes"] = torch.cuda.max_memory_allocated() - base
        out["device"] = torch.cuda.get_device_name(0)
    else:  # smoke test only
        out["peak_bytes"] = fxremat.measure(step, reps=1, warmup=0).peak_bytes
        out["device"] = "cpu (smoke test)"
    times = []
    for _ in range(int(ENV["REPS"])):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    out["step_s"] = statistics.median(times)
    out["min_step_s"] = min(times)
    out["compile_s"] = max(0.0, out["first_call_s"] - out["step_s"])
    if strategy == "fxremat":
        plans = fxremat.plans()
        out["predicted_peak"] = max((p.predicted_peak for p in plans), default=None)
        out["solve_s"] = sum(p.solve_seconds for p in plans)
        out["plans"] = len(plans)
    return out


# ---------------------------------------------------------------- driver
START = time.time()


def run(label, strategy, budget=None, on_infeasible="error", role=""):
    left = float(ENV["TOTAL_S"]) - (time.time() - START)
    rec = dict(label=label, strategy=strategy, budget=budget, role=role)
    if left < 30:
        rec["error"] = "skipped: overall deadline (TOTAL_S) reached"
    else:
        cmd = [sys.executable, __file__, "--row", strategy, str(budget), on_infeasible]
        t = min(float(ENV["ROW_TIMEOUT"]), left)
        log = os.path.join(WORK, f"row-{label.replace(' ', '_').replace('/', '_')}.log")
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=t)
            open(log, "w").write(p.stdout + "\n--- stderr\n" + p.stderr)
            lines = [l for l in p.stdout.splitlines() if l.startswith("ROW ")]
            if lines:
                rec.update(json.loads(lines[-1][4:]))
            else:
                tail = " | ".join(p.stderr.strip().splitlines()[-3:])[-300:]
                rec["error"] = f"failed (rc {p.returncode}): {tail}"
        except subprocess.TimeoutExpired:
            rec["error"] = f"timeout after {t:.0f} s"
    rec.update(label=label, role=role)
    with open(RESULTS, "a") as f:
        f.write(json.dumps(rec) + "\n")
    el = time.time() - START
    if "error" in rec:
        print(f"[{el:5.0f} s] {label:<32} {rec['error'][:200]}", flush=True)
    else:
        extra = (f"  predicted {rec['predicted_peak'] / MIB:9.1f} MiB  solve {rec['solve_s']:.2f} s"
                 if rec.get("predicted_peak") else "")
        print(f"[{el:5.0f} s] {label:<32} peak {rec['peak_bytes'] / MIB:9.1f} MiB  step {rec['step_s'] * 1e3:8.1f} ms"
              f"  compile {rec['compile_s']:6.1f} s{extra}", flush=True)
    return rec


def drive():
    open(RESULTS, "w").close()
    eager = run("eager", "eager")
    ckpt = run("checkpoint", "checkpoint")
    ind = run("inductor", "inductor")
    fast = run("fxremat, no budget", "fxremat", role="fastest")
    least = run("fxremat, least", "fxremat", 1, "min", role="least")
    hi, lo = fast.get("predicted_peak"), least.get("predicted_peak")
    budgets = []
    if "peak_bytes" in ind:
        budgets.append((ind["peak_bytes"] // 2, "half of Inductor's peak"))
    run("inductor_budget_0.5", "inductor_budget_0.5")
    if "peak_bytes" in ckpt:
        budgets.append((ckpt["peak_bytes"], "checkpoint's peak"))
    if hi and lo:
        budgets.append(((hi + lo) // 2, "midway"))
    for b, why in budgets:
        if lo and b < lo:
            r = dict(label=f"fxremat {b / MIB:.1f} MiB", strategy="fxremat", budget=b, role=why,
                     error=f"infeasible: below least predicted peak {lo / MIB:.1f} MiB (not run)")
            open(RESULTS, "a").write(json.dumps(r) + "\n")
            print(f"         {r['label']:<32} {r['error']}")
        elif hi and b >= hi:
            r = dict(label=f"fxremat {b / MIB:.1f} MiB", strategy="fxremat", budget=b, role=why,
                     error=f"not run: at or above the fastest plan's predicted peak {hi / MIB:.1f} MiB")
            open(RESULTS, "a").write(json.dumps(r) + "\n")
            print(f"         {r['label']:<32} {r['error']}")
        else:
            run(f"fxremat {b / MIB:.1f} MiB", "fxremat", b, role=why)
    run("inductor_budget_0.0", "inductor_budget_0.0")


def table():
    rows = [json.loads(l) for l in open(RESULTS)] if os.path.exists(RESULTS) else []
    ok = [r for r in rows if "error" not in r]
    others = [r for r in ok if r["strategy"] != "fxremat"]
    eager = next((r for r in ok if r["strategy"] == "eager"), None)
    ind = next((r for r in ok if r["strategy"] == "inductor"), None)
    desc = next((r["description"] for r in ok), "")
    dev = next((r["device"] for r in ok), "?")
    print()
    print(f"### fxremat GPU check: {dev}")
    print()
    print(desc + f"; {ENV['REPS']} timed steps; peak = max_memory_allocated above the pre-step baseline.")
    print()
    print("| strategy | budget MiB | peak MiB | step ms (median) | step ms (min) | compile s | solve s | "
          "predicted MiB | vs fastest non-fxremat at <= peak | grads vs eager |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = "" if r.get("budget") in (None, 1) else f"{r['budget'] / MIB:.1f}"
        if "error" in r:
            print(f"| {r['label']} | {b} | {r['error'][:150].replace('|', '/')} | | | | | | | |")
            continue
        vs = ""
        if r["strategy"] == "fxremat":
            c = [o for o in others if o["peak_bytes"] <= r["peak_bytes"]]
            best = min(c, key=lambda o: o["step_s"]) if c else None
            vs = f"{r['step_s'] / best['step_s']:.2f}x vs {best['strategy']}" if best else "none at <= this peak"
            if r.get("budget") not in (None, 1) and r["peak_bytes"] > r["budget"]:
                vs += " **OVER BUDGET**"
        g = ""
        if eager:
            same = all(math.isclose(r[k], eager[k], rel_tol=2e-2) for k in ("loss", "grad_norm"))
            g = "ok" if same else f"DIFFERS (loss {r['loss']:.4f}, |g| {r['grad_norm']:.4g})"
        sv = f"{r['solve_s']:.2f}" if "solve_s" in r else ""
        pr = f"{r['predicted_peak'] / MIB:.1f}" if r.get("predicted_peak") else ""
        print(f"| {r['label']} | {b} | {r['peak_bytes'] / MIB:.1f} | {r['step_s'] * 1e3:.1f} | "
              f"{r['min_step_s'] * 1e3:.1f} | {r['compile_s']:.1f} | {sv} | {pr} | {vs} | {g} |")
    fx = [r for r in ok if r["strategy"] == "fxremat"]
    if fx and others:
        lf, lo = min(fx, key=lambda r: r["peak_bytes"]), min(others, key=lambda r: r["peak_bytes"])
        print(f"\n(d) least peak: fxremat {lf['peak_bytes'] / MIB:.0f} MiB vs {lo['strategy']} "
              f"{lo['peak_bytes'] / MIB:.0f} MiB = {lf['peak_bytes'] / lo['peak_bytes']:.2f}x (target <= 0.90x)")
    if ind and fx:
        half = ind["peak_bytes"] // 2
        c = [r for r in fx if r["peak_bytes"] <= half]
        if c:
            h = min(c, key=lambda r: r["step_s"])
            print(f"(c) at half of Inductor's peak ({half / MIB:.0f} MiB): {h['label']} {h['step_s'] * 1e3:.1f} ms vs "
                  f"Inductor {ind['step_s'] * 1e3:.1f} ms = {h['step_s'] / ind['step_s']:.2f}x (target <= 1.10x)")
        else:
            print(f"(c) at half of Inductor's peak ({half / MIB:.0f} MiB): no fxremat row measured under it")
    for o in others:
        c = [f for f in fx if f["peak_bytes"] <= 1.02 * o["peak_bytes"]]
        best = min(c, key=lambda f: f["step_s"]) if c else None
        verdict = (f"{best['label']} {best['step_s'] / o['step_s']:.2f}x time at {best['peak_bytes'] / MIB:.0f} MiB"
                   + ("" if best["step_s"] <= 1.02 * o["step_s"] else " (not dominated)")) if best else "no fxremat point"
        print(f"(b) vs {o['strategy']} ({o['peak_bytes'] / MIB:.0f} MiB, {o['step_s'] * 1e3:.1f} ms): {verdict}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--row":
        strategy, budget, on_inf = sys.argv[2], sys.argv[3], sys.argv[4]
        try:
            rec = row(strategy, None if budget == "None" else int(budget), on_inf)
        except Exception as e:
            import traceback
            traceback.print_exc()
            rec = dict(error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}")
        print("ROW " + json.dumps(rec), flush=True)
    elif len(sys.argv) > 1 and sys.argv[1] == "--table":
        table()
    else:
        drive()
EOF

echo "== rows (each in a fresh process; timeout ${ROW_TIMEOUT} s; no new row after ${TOTAL_S} s)"
# The driver may fail or be killed; the table is printed from whatever rows were recorded.
timeout -k 10 "$((TOTAL_S + 30))" "$PY" "$WORK/bench.py" || echo "(driver ended with status $?; table from the rows recorded)"
"$PY" "$WORK/bench.py" --table
