"""fxremat against what users pick today, on one CUDA GPU (the GPU twin of benchmarks/compare.py).

    bash benchmarks/gpu_check.sh            # from anywhere; about 5-8 minutes on an H100/H200
    python benchmarks/gpu_check.py          # the same (gpu_check.sh is a thin wrapper around this file)
    python benchmarks/gpu_check.py --help   # the knobs
    GPU_CHECK_ALLOW_CPU=1 LAYERS=1 HIDDEN=64 HEADS=4 SEQ=64 BATCH=2 VOCAB=256 bash benchmarks/gpu_check.sh
                                            # smoke test of the logic on a CPU (the numbers mean nothing)

A GPT-2-style decoder in bf16 (plain PyTorch, no transformers needed), one training step
(forward returning the loss, then backward) per row, each row in a fresh process:

- eager; checkpoint (per-block torch.utils.checkpoint, non-reentrant); inductor (torch.compile default);
- inductor_budget_0.5 / 0.0 (torch._functorch.config.activation_memory_budget);
- fxremat with no budget (fastest plan), at its least peak (budget 1 B, on_infeasible="min"),
  and at budgets in bytes: half of Inductor's measured peak, the checkpoint row's measured
  peak, and midway between fxremat's fastest and least predicted peaks.

Peak = torch.cuda.max_memory_allocated() during the step minus memory_allocated() before it
(parameters, inputs and the .grad buffers of the warm-up step are in the baseline).
Step time = median of REPS synchronised steps after warm-up.

It installs nothing: torch must be there; fxremat is imported from this checkout (PYTHONPATH),
after an optional `pip install --no-deps --no-build-isolation -e .` that may fail harmlessly.
scipy is optional: without it fxremat's "auto" solver (min-cut + ILP) is replaced by "mincut".
Every row has a timeout; a failing or timed-out row is marked and the run goes on; rows
that would start within 30 s of the deadline (TOTAL_S) are marked "skipped". The markdown table is
printed last, also when rows failed.

Knobs (environment, or the flag of the same name: --total-s, --reps, ...): PYTHON (the interpreter
gpu_check.sh runs), TOTAL_S (400: every row ends by then), ROW_TIMEOUT (150), REPS (5), LAYERS (4),
HIDDEN (1024), HEADS (16), SEQ (1024), BATCH (32), VOCAB (8192), DIST_TIMEOUT (240: the one-rank FSDP2 run
of examples/distributed.py after the table, when transformers is installed; 0 skips it), KEEP_WORK=1 (keep the logs folder),
GPU_CHECK_ALLOW_CPU=1 (smoke-test the logic on a CPU).

Internally the same file is the driver (--drive: runs the rows, appends them to WORK/rows.jsonl),
one row (--row STRATEGY BUDGET ON_INFEASIBLE: prints one "ROW {json}" line) and the table
(--table [--work DIR]: prints the markdown table from WORK/rows.jsonl, e.g. of a KEEP_WORK=1 run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Every run plans afresh: the plan cache (fxremat/plan_cache.py) would hide planning time and planner changes.
os.environ.setdefault("FXREMAT_PLAN_CACHE", "0")

MIB = 2**20
REPO = Path(__file__).resolve().parent.parent
THIS = str(Path(__file__).resolve())

# Environment knobs: name -> (default, type, help). The flags --total-s, --row-timeout, ... override them;
# the values are written back into the environment, which the rows (subprocesses) read.
KNOBS = {
    "TOTAL_S": ("400", float, "overall deadline in seconds: every row ends by then"),
    "ROW_TIMEOUT": ("150", float, "timeout of one row in seconds"),
    "REPS": ("5", int, "timed steps per row (the median is reported)"),
    "LAYERS": ("4", int, "decoder blocks"),
    "HIDDEN": ("1024", int, "hidden size"),
    "HEADS": ("16", int, "attention heads"),
    "SEQ": ("1024", int, "tokens per sequence"),
    "BATCH": ("32", int, "sequences per step"),
    "VOCAB": ("8192", int, "vocabulary size"),
    "DIST_TIMEOUT": ("240", float, "timeout of the one-rank FSDP2 run of examples/distributed.py (0: skip it)"),
}
# Set for every row, as gpu_check.sh sets them (here too, so a direct `python benchmarks/gpu_check.py` is the same).
FIXED_ENV = {
    "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",  # every row really compiles
    "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
    "PYTHONWARNINGS": "ignore",
    "TOKENIZERS_PARALLELISM": "false",
}
START_MARGIN_S = 30  # no row starts within this many seconds of the deadline
PIP_TIMEOUT_S = 120
DRIVER_GRACE_S = 30  # the driver is stopped TOTAL_S + this after it started ...
DRIVER_KILL_AFTER_S = 10  # ... and killed this much later if it ignores SIGTERM


def knob(name: str) -> int | float:
    default, kind, _ = KNOBS[name]
    return kind(os.environ.get(name, default))


def work_dir() -> str:
    return os.environ["WORK"]


def results_path(work: str | None = None) -> str:
    return os.path.join(work or work_dir(), "rows.jsonl")


# ---------------------------------------------------------------- the model
def build():
    """The model (bf16, on the GPU if there is one), a batch of token ids and a one-line description."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    L, H, NH, S, B, V = (knob(k) for k in ("LAYERS", "HIDDEN", "HEADS", "SEQ", "BATCH", "VOCAB"))

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
            logits = self.ln_f(x) @ self.wte.weight.t()  # tied LM head
            return F.cross_entropy(logits[:, :-1].float().reshape(-1, V), ids[:, 1:].reshape(-1))

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = GPT().to(device=dev, dtype=torch.bfloat16)
    ids = torch.randint(0, V, (B, S), device=dev)
    desc = (
        f"GPT-2-style decoder, {L} layers, hidden {H}, {NH} heads, {S} tokens, batch {B}, vocabulary {V}, "
        f"bf16 weights and activations, fp32 loss, SDPA causal, per-block checkpoint for 'checkpoint'"
    )
    return model, ids, desc


# ---------------------------------------------------------------- one row (runs in its own process)
def compiled(model, strategy: str, budget: int | None, on_infeasible: str, out: dict):
    """The callable that runs one forward for ``strategy`` (``out`` gets a note if the solver changes)."""
    import torch

    import fxremat

    if strategy == "eager":
        return model
    if strategy == "checkpoint":
        model.checkpoint = True
        return model
    if strategy.startswith("inductor"):
        if strategy.startswith("inductor_budget_"):
            torch._functorch.config.activation_memory_budget = float(strategy.rsplit("_", 1)[1])
        return torch.compile(model)
    if strategy == "fxremat":
        opts: dict = {} if budget is None else {"budget": budget, "on_infeasible": on_infeasible}
        try:
            import scipy.optimize  # noqa: F401  (the ILP half of solver="auto")
        except ImportError:
            opts["solver"] = "mincut"
            out["note"] = "scipy missing: solver=mincut"
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0).lower()
            for hw in ("h200", "h100", "a100"):
                if hw in name:
                    opts["hardware"] = hw
        return torch.compile(model, backend=fxremat.backend(**opts))
    raise ValueError(strategy)


def row(strategy: str, budget: int | None, on_infeasible: str) -> dict:
    """Build the model, compile it for ``strategy``, and measure one training step: a JSON-able dict."""
    import torch

    import fxremat

    model, ids, desc = build()
    cuda = torch.cuda.is_available()
    out = {"strategy": strategy, "budget": budget, "description": desc}
    fn = compiled(model, strategy, budget, on_infeasible, out)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        fn(ids).backward()

    t0 = time.perf_counter()
    loss = fn(ids)
    loss.backward()
    sync()
    out["first_call_s"] = time.perf_counter() - t0
    out["loss"] = float(loss.detach().float())
    grads = (p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None)
    out["grad_norm"] = float(sum(grads) ** 0.5)
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
    for _ in range(knob("REPS")):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    out["step_s"] = statistics.median(times)
    out["min_step_s"] = min(times)
    out["compile_s"] = max(0.0, out["first_call_s"] - out["step_s"])
    if strategy == "fxremat":
        plans = fxremat.running_plans()  # the plans the measured steps ran
        out["predicted_peak"] = max((p.predicted_peak for p in plans), default=None)
        out["solve_s"] = sum(p.solve_seconds for p in fxremat.plans())
        out["plans"] = len(fxremat.plans())
    return out


def row_main(strategy: str, budget: str, on_infeasible: str) -> None:
    """--row: one row; its result (or its error) as the last line, ``ROW {json}``."""
    try:
        rec = row(strategy, None if budget == "None" else int(budget), on_infeasible)
    except Exception as e:  # noqa: BLE001  (any failure is the row's result)
        import traceback

        traceback.print_exc()
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        rec = {"error": f"{type(e).__name__}: {first}"}
    print("ROW " + json.dumps(rec), flush=True)


# ---------------------------------------------------------------- the driver (--drive)
def _text(out: str | bytes | None) -> str:
    """A timed-out subprocess's partial output (bytes, even with text=True, on some Pythons)."""
    if out is None:
        return ""
    return out.decode(errors="replace") if isinstance(out, bytes) else out


class Driver:
    """Runs the rows one after the other, each in a fresh process, within the overall deadline."""

    def __init__(self):
        self.start = time.time()
        self.results = results_path()
        open(self.results, "w").close()

    def record(self, rec: dict) -> None:
        with open(self.results, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def run(self, label: str, strategy: str, budget: int | None = None, on_infeasible="error", role="") -> dict:
        left = knob("TOTAL_S") - (time.time() - self.start)
        rec: dict = {"label": label, "strategy": strategy, "budget": budget, "role": role}
        if left < START_MARGIN_S:
            rec["error"] = "skipped: overall deadline (TOTAL_S) reached"
        else:
            rec.update(self.subprocess_row(label, strategy, budget, on_infeasible, min(knob("ROW_TIMEOUT"), left)))
        rec.update(label=label, role=role)
        self.record(rec)
        el = time.time() - self.start
        if "error" in rec:
            print(f"[{el:5.0f} s] {label:<32} {rec['error'][:200]}", flush=True)
        else:
            extra = ""
            if rec.get("predicted_peak"):
                extra = f"  predicted {rec['predicted_peak'] / MIB:9.1f} MiB  solve {rec['solve_s']:.2f} s"
            print(
                f"[{el:5.0f} s] {label:<32} peak {rec['peak_bytes'] / MIB:9.1f} MiB  "
                f"step {rec['step_s'] * 1e3:8.1f} ms  compile {rec['compile_s']:6.1f} s{extra}",
                flush=True,
            )
        return rec

    @staticmethod
    def subprocess_row(label: str, strategy: str, budget: int | None, on_infeasible: str, timeout: float) -> dict:
        """Run ``--row`` in a fresh process; its log goes to WORK/row-LABEL.log. The row's dict, or {"error"}."""
        cmd = [sys.executable, THIS, "--row", strategy, str(budget), on_infeasible]
        log = os.path.join(work_dir(), f"row-{label.replace(' ', '_').replace('/', '_')}.log")
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as e:  # keep what the row printed: where did its time go
            with open(log, "w") as f:
                f.write(_text(e.stdout) + "\n--- stderr\n" + _text(e.stderr) + f"\n--- timeout after {timeout:.0f} s\n")
            return {"error": f"timeout after {timeout:.0f} s"}
        with open(log, "w") as f:
            f.write(p.stdout + "\n--- stderr\n" + p.stderr)
        lines = [line for line in p.stdout.splitlines() if line.startswith("ROW ")]
        if lines:
            return json.loads(lines[-1][4:])
        tail = " | ".join(p.stderr.strip().splitlines()[-3:])[-300:]
        return {"error": f"failed (rc {p.returncode}): {tail}"}

    def not_run(self, budget: int, why: str, error: str) -> None:
        """A budget row that is not worth running, recorded with its reason."""
        label = f"fxremat {budget / MIB:.1f} MiB"
        rec = {"label": label, "strategy": "fxremat", "budget": budget, "role": why, "error": error}
        self.record(rec)
        print(f"         {rec['label']:<32} {rec['error']}")


def drive() -> None:
    """All the rows, in this order; fxremat's budget rows are placed between its fastest and least plans."""
    d = Driver()
    d.run("eager", "eager")
    ckpt = d.run("checkpoint", "checkpoint")
    ind = d.run("inductor", "inductor")
    fast = d.run("fxremat, no budget", "fxremat", role="fastest")
    least = d.run("fxremat, least", "fxremat", 1, "min", role="least")
    hi, lo = fast.get("predicted_peak"), least.get("predicted_peak")
    budgets = []
    if "peak_bytes" in ind:
        budgets.append((ind["peak_bytes"] // 2, "half of Inductor's peak"))
    d.run("inductor_budget_0.5", "inductor_budget_0.5")
    if "peak_bytes" in ckpt:
        budgets.append((ckpt["peak_bytes"], "checkpoint's peak"))
    if hi and lo:
        budgets.append(((hi + lo) // 2, "midway"))
    for b, why in budgets:
        if lo and b < lo:
            d.not_run(b, why, f"infeasible: below least predicted peak {lo / MIB:.1f} MiB (not run)")
        elif hi and b >= hi:
            d.not_run(b, why, f"not run: at or above the fastest plan's predicted peak {hi / MIB:.1f} MiB")
        else:
            d.run(f"fxremat {b / MIB:.1f} MiB", "fxremat", b, role=why)
    d.run("inductor_budget_0.0", "inductor_budget_0.0")


# ---------------------------------------------------------------- the table (--table)
def table(work: str | None = None) -> None:
    """The markdown table of the rows recorded so far, then the (b)/(c)/(d) verdicts."""
    path = results_path(work)
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f]
    ok = [r for r in rows if "error" not in r]
    others = [r for r in ok if r["strategy"] != "fxremat"]
    fx = [r for r in ok if r["strategy"] == "fxremat"]
    eager = next((r for r in ok if r["strategy"] == "eager"), None)
    ind = next((r for r in ok if r["strategy"] == "inductor"), None)
    desc = next((r["description"] for r in ok), "")
    dev = next((r["device"] for r in ok), "?")
    print()
    print(f"### fxremat GPU check: {dev}")
    print()
    print(desc + f"; {knob('REPS')} timed steps; peak = max_memory_allocated above the pre-step baseline.")
    print()
    print(
        "| strategy | budget MiB | peak MiB | step ms (median) | step ms (min) | compile s | solve s | "
        "predicted MiB | vs fastest non-fxremat at <= peak | grads vs eager |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(table_line(r, others, eager))
    verdicts(fx, others, ind)


def table_line(r: dict, others: list[dict], eager: dict | None) -> str:
    b = "" if r.get("budget") in (None, 1) else f"{r['budget'] / MIB:.1f}"
    if "error" in r:
        return f"| {r['label']} | {b} | {r['error'][:150].replace('|', '/')} | | | | | | | |"
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
    return (
        f"| {r['label']} | {b} | {r['peak_bytes'] / MIB:.1f} | {r['step_s'] * 1e3:.1f} | "
        f"{r['min_step_s'] * 1e3:.1f} | {r['compile_s']:.1f} | {sv} | {pr} | {vs} | {g} |"
    )


def verdicts(fx: list[dict], others: list[dict], ind: dict | None) -> None:
    """(d) least peak, (c) speed at half of Inductor's peak, (b) dominance over each non-fxremat row."""
    if fx and others:
        lf, lo = min(fx, key=lambda r: r["peak_bytes"]), min(others, key=lambda r: r["peak_bytes"])
        print(
            f"\n(d) least peak: fxremat {lf['peak_bytes'] / MIB:.0f} MiB vs {lo['strategy']} "
            f"{lo['peak_bytes'] / MIB:.0f} MiB = {lf['peak_bytes'] / lo['peak_bytes']:.2f}x (target <= 0.90x)"
        )
    if ind and fx:
        half = ind["peak_bytes"] // 2
        c = [r for r in fx if r["peak_bytes"] <= half]
        if c:
            h = min(c, key=lambda r: r["step_s"])
            print(
                f"(c) at half of Inductor's peak ({half / MIB:.0f} MiB): {h['label']} {h['step_s'] * 1e3:.1f} ms vs "
                f"Inductor {ind['step_s'] * 1e3:.1f} ms = {h['step_s'] / ind['step_s']:.2f}x (target <= 1.10x)"
            )
        else:
            print(f"(c) at half of Inductor's peak ({half / MIB:.0f} MiB): no fxremat row measured under it")
    for o in others:
        c = [f for f in fx if f["peak_bytes"] <= 1.02 * o["peak_bytes"]]
        best = min(c, key=lambda f: f["step_s"]) if c else None
        if best:
            verdict = f"{best['label']} {best['step_s'] / o['step_s']:.2f}x time at {best['peak_bytes'] / MIB:.0f} MiB"
            verdict += "" if best["step_s"] <= 1.02 * o["step_s"] else " (not dominated)"
        else:
            verdict = "no fxremat point"
        print(f"(b) vs {o['strategy']} ({o['peak_bytes'] / MIB:.0f} MiB, {o['step_s'] * 1e3:.1f} ms): {verdict}")


# ---------------------------------------------------------------- the whole check (no mode flag)
def prepare_env(work: str) -> None:
    """The environment every subprocess (info, pip, driver, rows) inherits."""
    env = os.environ
    for name, (default, _, _) in KNOBS.items():
        env.setdefault(name, default)
    env["WORK"] = work
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(work, "inductor-cache")  # fresh kernel cache, shared by the rows
    env.update(FIXED_ENV)
    path = env.get("PYTHONPATH", "")
    if path.split(os.pathsep)[0] != str(REPO):
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + path if path else "")
    env.pop("FXREMAT_BUDGET", None)


def info() -> None:
    """--info: the Python, torch and CUDA versions, and the GPU; exits if there is none (unless allowed)."""
    import torch

    print(
        f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, "
        f"available {torch.cuda.is_available()}"
    )
    if not torch.cuda.is_available() and os.environ.get("GPU_CHECK_ALLOW_CPU") != "1":
        sys.exit(
            "gpu_check.sh: CUDA is not available; this script measures a GPU (GPU_CHECK_ALLOW_CPU=1 to smoke-test)"
        )
    if torch.cuda.is_available():
        print("device", torch.cuda.get_device_name(0))


def python(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], check=False, **kwargs)


def machine(work: str) -> int:
    """Print the machine; install fxremat (optional) and print where it is imported from. 0, or an exit status."""
    print("== machine")
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
        print(smi.stdout.rstrip("\n") if smi.returncode == 0 else "(no nvidia-smi)")
    except OSError:
        print("(no nvidia-smi)")
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"nproc {nproc}")
    rc = python(THIS, "--info").returncode  # torch is imported in subprocesses only
    if rc:
        return rc
    installed = "import importlib.metadata as m; m.version('fxremat')"
    if python("-c", installed, capture_output=True).returncode != 0:
        pip_install(work)
    where = "import fxremat; print('fxremat', fxremat.__version__, 'from', fxremat.__file__)"
    return python("-c", where).returncode


def pip_install(work: str) -> None:
    print("== pip install --no-deps --no-build-isolation -e . (optional; PYTHONPATH covers a failure)")
    log = os.path.join(work, "pip.log")
    cmd = ["-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", "."]
    with open(log, "w") as f:
        try:
            ok = python(*cmd, stdout=f, stderr=subprocess.STDOUT, timeout=PIP_TIMEOUT_S, cwd=REPO).returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
    if not ok:
        print(f"   pip install failed; continuing with PYTHONPATH={REPO}. Its last lines:")
        with open(log) as f:
            print("".join(f.readlines()[-3:]), end="")


def run_driver() -> int:
    """The driver in its own process group, stopped (then killed) if it outlives the deadline: like `timeout -k`."""
    limit = knob("TOTAL_S") + DRIVER_GRACE_S
    proc = subprocess.Popen([sys.executable, THIS, "--drive"], start_new_session=True)
    try:
        return proc.wait(limit)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(DRIVER_KILL_AFTER_S)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid, signal.SIGKILL)
            proc.wait()
        return 124
    except BaseException:  # Ctrl-C: the driver and its rows are in their own group, so stop them here
        kill_group(proc.pid, signal.SIGKILL)
        raise


def kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the whole group has ended already
        pass


def check() -> int:
    """The whole check: machine info, the rows (each in a fresh process), then the table."""
    os.chdir(REPO)
    work = tempfile.mkdtemp(prefix="fxremat-gpu-check.", dir=os.environ.get("TMPDIR") or "/tmp")
    try:
        prepare_env(work)
        rc = machine(work)
        if rc:
            return rc
        print(
            f"== rows (each in a fresh process; timeout {os.environ['ROW_TIMEOUT']} s; "
            f"no new row after {os.environ['TOTAL_S']} s)"
        )
        # The driver may fail or be killed; the table is printed from whatever rows were recorded.
        rc = run_driver()
        if rc:
            print(f"(driver ended with status {rc}; table from the rows recorded)")
        table()
        distributed_example()
        return 0
    finally:
        if os.environ.get("KEEP_WORK", "0") != "1":
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs kept in {work}")


def distributed_example() -> None:
    """examples/distributed.py on one rank (NCCL on the GPU): FSDP2 Llama under a per-rank budget, its
    loss and gradients against one process, its measured peak against the budget. Needs transformers."""
    timeout = knob("DIST_TIMEOUT")
    if timeout <= 0:
        return
    if python("-c", "import transformers", capture_output=True).returncode != 0:
        print("== distributed example: skipped (transformers is not installed)")
        return
    cuda = python("-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)").returncode == 0
    args = ["--device", "cuda", "--budget", "128MiB", "--tokens", "512", "--batch", "8"] if cuda else ["--small"]
    cmd = ["-m", "torch.distributed.run", "--nproc-per-node", "1", "examples/distributed.py", *args]
    print(f"== distributed example (one rank): python {' '.join(cmd)}")
    try:
        rc = python(*cmd, timeout=timeout, cwd=REPO).returncode
    except subprocess.TimeoutExpired:
        print(f"distributed example: timed out after {timeout:g} s")
        return
    print(f"distributed example: {'passed' if rc == 0 else f'FAILED (status {rc})'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="fxremat against eager, checkpoint and Inductor on one CUDA GPU (see the module docstring).",
        epilog="Each knob also reads the environment variable of the same name (TOTAL_S, REPS, ...); "
        "KEEP_WORK=1 keeps the logs folder, GPU_CHECK_ALLOW_CPU=1 allows a smoke test on a CPU.",
    )
    for name, (default, kind, text) in KNOBS.items():
        flag = "--" + name.lower().replace("_", "-")
        ap.add_argument(flag, type=kind, metavar=name, help=f"{text} (env {name}, default {default})")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--row", nargs=3, metavar=("STRATEGY", "BUDGET", "ON_INFEASIBLE"), help="internal: one row")
    mode.add_argument("--drive", action="store_true", help="internal: run the rows into WORK/rows.jsonl")
    mode.add_argument("--table", action="store_true", help="print the table of WORK/rows.jsonl")
    mode.add_argument("--info", action="store_true", help="internal: python, torch and GPU versions")
    ap.add_argument("--work", help="the run's folder (default: env WORK; a fresh temporary one for the whole check)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for name in KNOBS:  # flags win over the environment; the rows read the environment
        value = getattr(args, name.lower())
        if value is not None:
            os.environ[name] = f"{value:g}" if isinstance(value, float) else str(value)
    if args.work:
        os.environ["WORK"] = args.work
    if hasattr(sys.stdout, "reconfigure"):  # keep our lines in order with the subprocesses' output
        sys.stdout.reconfigure(line_buffering=True)
    if args.row:
        row_main(*args.row)
    elif args.drive:
        drive()
    elif args.table:
        table()
    elif args.info:
        info()
    else:
        return check()
    return 0


if __name__ == "__main__":
    sys.exit(main())
