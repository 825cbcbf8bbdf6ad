"""Training speed: saffu's transformer step against the revision before the speed work and
against the same model written in PyTorch (eager and ``torch.compile``), on one core and on both.

Every variant trains the same model (V 8,192, width 128, 5 layers, 4 heads, context 32 + 256
targets, 16 windows a step, AdamW, float32) from the same init on the same batches (the
trainer's own batch schedule over the prepared corpus, or random tokens without one), each in a
process of its own pinned with ``taskset`` (one process at a time), in alternating rounds; the
median seconds per step of the rounds is kept. On both cores saffu runs three ways: one process
(XLA's threads), one process over two forced host devices (``--devices 2``) and two processes,
one pinned to each core, joined by ``jax.distributed`` (``--num-processes 2``). Each variant
reports the mean training loss of its steps and the loss of its final parameters on the first batch, so a speed-up is never a
different computation. XLA's FLOP count of one step gives the achieved GFLOP/s of every variant
(one count for the model, so the GFLOP/s ratios are the speed ratios). saffu's step is also
profiled op by op (the top ops by time).

    python experiments/bench_train.py --before ../saffu-before          # table + --metrics-json
    python experiments/bench_train.py --before ../saffu-before --write-result
    python experiments/bench_train.py --quick                           # small model, one round

``--before DIR`` is a checkout of the revision to compare with (``git worktree add DIR REV``);
without it that row is left out. The PyTorch rows need ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: (name, what runs it, cores): the variants of one round. Cores: "0" one core, "0,1" both.
VARIANTS = (("saffu", "saffu", "0"), ("saffu-before", "saffu", "0"), ("torch-eager", "torch", "0"),
            ("torch-compile", "torch", "0"),
            ("saffu", "saffu", "0,1"), ("saffu-dp2", "saffu", "0,1"), ("saffu-mp2", "saffu", "0,1"),
            ("saffu-before", "saffu", "0,1"),
            ("torch-eager", "torch", "0,1"), ("torch-compile", "torch", "0,1"))


@dataclasses.dataclass
class Options:
    """The model, the variants and the timing.

    Attributes:
      workdir: a prepared work directory whose training tokens make the batches (random tokens if absent)
      before: a checkout of the revision to compare with (its saffu/ is imported)
      vocab_size: vocabulary size V
      width: model width d
      layers: transformer layers
      heads: attention heads
      context: context tokens before a window's targets
      batch_size: windows per step
      seq_len: targets per window
      warm_steps: untimed steps first (compilation)
      steps: timed steps per variant and round
      rounds: alternating rounds (the median is kept)
      variants: comma-separated names[@cores] to run (default: all), e.g. saffu@1,torch-eager@1,saffu-mp2@2
      quick: a small model, one round (about two minutes)
      metrics_json: also write the figures here
      write_result: write results/bench_train.json
    """

    workdir: Path = ROOT / "runs" / "babylm"
    before: Path | None = None
    vocab_size: int = 8192
    width: int = 128
    layers: int = 5
    heads: int = 4
    context: int = 32
    batch_size: int = 16
    seq_len: int = 256
    warm_steps: int = 8
    steps: int = 6
    rounds: int = 2
    variants: str | None = None
    quick: bool = False
    metrics_json: Path | None = None
    write_result: bool = False


def parse_args(argv=None) -> Options:
    # imported here, not at the top: a variant's process (:func:`child`) imports its own saffu
    from saffu.flags import script_options
    return script_options(Options, argv, __doc__.splitlines()[0])


# ------------------------------------------------------------------------------------- children


def _page_faults() -> int:
    """Minor page faults of this process so far (memory touched for the first time)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _load_spec(path: Path) -> tuple[dict, np.ndarray]:
    spec = json.loads(path.read_text())
    return spec, np.load(spec["batches"])


def _saffu_child(spec: dict, batches: np.ndarray, data_parallel: bool, profile: bool,
                 job: tuple[str, int] | None = None) -> dict:
    """One saffu variant (whichever ``saffu`` package is first on the path): seconds per step,
    losses, XLA's FLOPs of the step and, with ``profile``, the top ops of the step by time.
    ``job``: ``(coordinator, process id)`` of a two-process data-parallel job."""
    import jax
    import jax.numpy as jnp

    import saffu
    if job is not None:
        from saffu.engine import distributed
        distributed.initialize(job[0], 2, job[1])
    from saffu.configs import TrainConfig, TransformerConfig
    from saffu.models.interface import model_init, target_loss
    from saffu.training.trainer import StepStats, make_optimizer, make_train_step

    # the gpt block with an output bias, which a revision from before the block choice has alone
    block = {"block": "gpt", "output_bias": True} if "block" in TransformerConfig.__dataclass_fields__ else {}
    model = TransformerConfig(spec["vocab_size"], spec["width"], spec["layers"], spec["heads"],
                              context_tokens=spec["context"], **block)
    total = spec["warm_steps"] + spec["steps"]
    config = TrainConfig(steps=total, batch_size=spec["batch_size"], seq_len=spec["seq_len"], warmup_steps=2)
    optimizer = make_optimizer(config, total)
    params = model_init(model, jax.random.key(0))
    opt_state, stats = optimizer.init(params), StepStats.zeros()
    mask = np.ones((spec["batch_size"], spec["seq_len"]), bool)
    put = jax.device_put
    if data_parallel:
        from jax.sharding import NamedSharding, PartitionSpec

        from saffu.engine.distributed import put_global
        from saffu.training.trainer import data_parallel_mesh
        mesh = data_parallel_mesh(None if job else 2)
        replicated, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
        params, opt_state, stats = put_global((params, opt_state, stats), replicated)
        put = lambda x: put_global(np.asarray(x), split)
    # the revision before takes no mesh argument (it runs only on one device here)
    step_fn = make_train_step(model, optimizer, config, mesh) if data_parallel else make_train_step(model, optimizer, config)
    first = (put(jnp.asarray(batches[0])), put(jnp.asarray(mask)))
    compiled = step_fn.lower(params, opt_state, stats, jnp.int32(0), *first, {}).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    inputs = [(put(jnp.asarray(batches[i % len(batches)])), put(jnp.asarray(mask))) for i in range(total)]
    for i in range(total):
        if i == spec["warm_steps"]:
            jax.block_until_ready(params)
            start, faults = time.perf_counter(), _page_faults()
        params, opt_state, stats = compiled(params, opt_state, stats, jnp.int32(i), *inputs[i], {})
    jax.block_until_ready(stats)
    seconds = (time.perf_counter() - start) / spec["steps"]
    faults = (_page_faults() - faults) / spec["steps"]
    if job is not None:    # the final loss on one process's copy of the parameters
        from saffu.engine.distributed import local_copy
        params, first = local_copy(params), (jnp.asarray(batches[0]), jnp.asarray(mask))
    nll, count = jax.jit(lambda p, w, m: target_loss(p, model, w, m))(params, *first)
    result = {"seconds_per_step": seconds, "mean_train_loss": float(stats.loss_sum) / int(stats.applied),
              "final_loss": float(nll) / int(count), "xla_flops": float(cost.get("flops", 0.0)),
              "page_faults_per_step": faults, "devices": len(jax.devices()),
              "package": str(Path(saffu.__file__).resolve().parent)}
    if profile:
        result["profile"] = _profile(compiled, params, opt_state, stats, inputs[0])
    return result


def _profile(compiled, params, opt_state, stats, batch, steps: int = 2, top: int = 15) -> list[dict]:
    """The step's ops by time: ``[{op, kind, what, shape, ms_per_step, share}]`` for the
    ``top`` ops, from a ``jax.profiler`` trace of ``steps`` steps joined with the compiled HLO
    (each op's JAX source operation and result shape)."""
    import jax
    import jax.numpy as jnp
    from jax.profiler import ProfileData

    hlo = {}
    for line in compiled.as_text().splitlines():
        found = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) (\w+)\(.*?op_name=\"([^\"]*)\"", line)
        if found:
            hlo[found.group(1)] = (found.group(2), found.group(3), found.group(4))
    with tempfile.TemporaryDirectory() as trace:
        jax.profiler.start_trace(trace)
        for i in range(steps):
            params, opt_state, stats = compiled(params, opt_state, stats, jnp.int32(i), *batch, {})
        jax.block_until_ready(stats)
        jax.profiler.stop_trace()
        data = ProfileData.from_file(glob.glob(f"{trace}/**/*.xplane.pb", recursive=True)[-1])
        times = collections.Counter()
        for plane in data.planes:
            for line in plane.lines:
                if not line.name.startswith("tf_XLAEigen"):
                    continue
                for event in line.events:
                    # the executor's own spans and loops hold other ops: count the leaves only
                    if not event.name.startswith("Thunk") and not event.name.startswith("while"):
                        times[event.name] += event.duration_ns / 1e6 / steps
    whole = sum(times.values())
    groups: dict[tuple, list] = {}
    for name, ms in times.items():      # the same operation at every layer is one row
        shape, kind, what = hlo.get(name, ("", "other", "ops without a JAX source operation (copies, loop steps)"))
        kind = "matmul" if name.startswith("dot") or "dot_general" in what else kind
        group = groups.setdefault((kind, shape.split("{")[0], re.sub(r"^jit\(step_fn\)/", "", what)), [0.0, 0])
        group[0] += ms
        group[1] += 1
    rows = [{"kind": kind, "shape": shape, "what": what, "ops": count, "ms_per_step": ms, "share": ms / whole}
            for (kind, shape, what), (ms, count) in groups.items()]
    return sorted(rows, key=lambda row: -row["ms_per_step"])[:top]


def _torch_child(spec: dict, batches: np.ndarray, compile_: bool, threads: int) -> dict:
    """The same transformer in PyTorch (a nanoGPT-style module: fused QKV, ``scaled_dot_product_attention``,
    tanh-GELU, pre-norm, learned positions, untied output with a bias), AdamW with the same
    schedule and clipping, started from saffu's init (``spec["init"]``)."""
    import torch

    torch.set_num_threads(threads)
    init = dict(np.load(spec["init"]))
    model = _torch_model(spec, init)
    total = spec["warm_steps"] + spec["steps"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    warmup = 2
    schedule = lambda i: (i / warmup if i < warmup
                          else 0.5 * (1 + np.cos(np.pi * (i - warmup) / max(total - warmup, 1))))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    context = spec["context"]

    def loss_of(module, windows):
        return module(windows[:, :-1], windows[:, context:], context - 1)

    forward = torch.compile(model) if compile_ else model
    windows = [torch.from_numpy(batches[i % len(batches)].astype(np.int64)) for i in range(total)]
    losses = []
    for i in range(total):
        if i == spec["warm_steps"]:
            start, faults = time.perf_counter(), _page_faults()
        loss = loss_of(forward, windows[i])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.detach())
    seconds = (time.perf_counter() - start) / spec["steps"]
    faults = (_page_faults() - faults) / spec["steps"]
    with torch.no_grad():
        final = float(loss_of(model, windows[0]))
    return {"seconds_per_step": seconds, "mean_train_loss": float(torch.stack(losses).mean()), "final_loss": final,
            "page_faults_per_step": faults, "torch": torch.__version__, "threads": threads}


def _torch_model(spec: dict, init: dict):
    """The PyTorch module with saffu's initial weights (flax's ``[in, out]`` kernels transposed)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    d, heads, eod = spec["width"], spec["heads"], spec["eod_id"]
    tensor = lambda name: torch.from_numpy(np.ascontiguousarray(init[name]))

    def linear(prefix_or_kernel, bias, n_in, n_out):
        layer = nn.Linear(n_in, n_out)
        with torch.no_grad():
            layer.weight.copy_(prefix_or_kernel.reshape(n_in, n_out).T)
            layer.bias.copy_(bias.reshape(n_out))
        return layer

    def norm(prefix):
        layer = nn.LayerNorm(d, eps=1e-6)
        with torch.no_grad():
            layer.weight.copy_(tensor(f"{prefix}/scale"))
            layer.bias.copy_(tensor(f"{prefix}/bias"))
        return layer

    class Block(nn.Module):
        def __init__(self, i):
            super().__init__()
            p = f"blocks/{i}"
            qkv = [tensor(f"{p}/attention/{n}/kernel").reshape(d, d) for n in ("query", "key", "value")]
            qkv_bias = [tensor(f"{p}/attention/{n}/bias").reshape(d) for n in ("query", "key", "value")]
            self.ln_1, self.ln_2 = norm(f"{p}/attention_norm"), norm(f"{p}/mlp_norm")
            self.attn = linear(torch.cat(qkv, 1), torch.cat(qkv_bias), d, 3 * d)
            self.proj = linear(tensor(f"{p}/attention/out/kernel"), tensor(f"{p}/attention/out/bias"), d, d)
            hidden = tensor(f"{p}/mlp_in/kernel").shape[1]
            self.fc = linear(tensor(f"{p}/mlp_in/kernel"), tensor(f"{p}/mlp_in/bias"), d, hidden)
            self.fc_out = linear(tensor(f"{p}/mlp_out/kernel"), tensor(f"{p}/mlp_out/bias"), hidden, d)

        def forward(self, x, mask):
            b, s, _ = x.shape
            q, k, v = self.attn(self.ln_1(x)).split(d, dim=2)
            q, k, v = (t.view(b, s, heads, d // heads).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
            return x + self.fc_out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding.from_pretrained(tensor("embed/embedding"), freeze=False)
            self.positions = nn.Parameter(tensor("positions"))
            self.blocks = nn.ModuleList(Block(i) for i in range(spec["layers"]))
            self.ln_f = norm("final_norm")
            self.head = linear(tensor("output/kernel"), tensor("output/bias"), d, spec["vocab_size"])

        def forward(self, tokens, targets, predict_from):
            s = tokens.shape[1]
            boundaries = torch.cumsum(tokens == eod, dim=1)
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            mask = ((boundaries[:, :, None] == boundaries[:, None, :]) & causal)[:, None]
            x = self.embed(tokens) + self.positions[:s]
            for block in self.blocks:
                x = block(x, mask)
            logits = self.head(self.ln_f(x[:, predict_from:]))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return GPT()


def child(name: str, spec_path: str, out: str, process_id: int = 0, coordinator: str | None = None) -> None:
    """One variant's process (:func:`_run_child`): its figures written to ``out`` (by process 0)."""
    spec, batches = _load_spec(Path(spec_path))
    if name.startswith("torch"):
        result = _torch_child(spec, batches, name == "torch-compile", spec["threads"])
    else:
        job = (coordinator, process_id) if name == "saffu-mp2" else None
        result = _saffu_child(spec, batches, name in ("saffu-dp2", "saffu-mp2"), spec.get("profile", False), job)
    if process_id == 0:
        Path(out).write_text(json.dumps(result))


# --------------------------------------------------------------------------------------- parent


def _prepare(args, folder: Path) -> dict:
    """Write the batches (``[steps, B, context + T]`` int32) and saffu's init (flattened names)
    that every variant reads; return the spec."""
    import jax

    from saffu.configs import TrainConfig, TransformerConfig
    from saffu.data.tokenizer import EOD_ID
    from saffu.models.interface import model_init
    from saffu.training.trainer import BatchSchedule

    model = TransformerConfig(args.vocab_size, args.width, args.layers, args.heads, context_tokens=args.context,
                              block="gpt", output_bias=True)
    total = args.warm_steps + args.steps
    if (args.workdir / "meta.json").exists():
        from saffu.data.workdir import open_workdir
        work = open_workdir(args.workdir)
        if work.vocab_size != args.vocab_size:
            raise SystemExit(f"{args.workdir} has {work.vocab_size:,} tokens, not --vocab-size {args.vocab_size:,}")
        stream = np.asarray(work.tokens(work.train_split))
        source = f"{args.workdir} ({work.train_split})"
    else:
        stream = np.random.default_rng(0).integers(2, args.vocab_size, 200_000).astype(np.int32)
        source = "random tokens"
    schedule = BatchSchedule(stream, model, TrainConfig(batch_size=args.batch_size, seq_len=args.seq_len))
    batches = np.stack([np.asarray(schedule(i)[0]) for i in range(total)]).astype(np.int32)
    np.save(folder / "batches.npy", batches)
    params = model_init(model, jax.random.key(0))
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    np.savez(folder / "init.npz", **flat)
    return {"vocab_size": args.vocab_size, "width": args.width, "layers": args.layers, "heads": args.heads,
            "context": args.context, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "warm_steps": args.warm_steps, "steps": args.steps, "eod_id": EOD_ID, "backend": jax.default_backend(),
            "batches": str(folder / "batches.npy"), "init": str(folder / "init.npz"), "data": source}


def _run_child(name: str, cores: str, spec: dict, folder: Path, before: Path | None, profile: bool = False) -> dict:
    """One variant in its own process pinned to ``cores``."""
    spec = {**spec, "threads": len(cores.split(",")), "profile": profile}
    spec_path, out = folder / "spec.json", folder / "out.json"
    spec_path.write_text(json.dumps(spec))
    out.unlink(missing_ok=True)
    # the process calls child() and parses no flags, so it imports its variant's saffu only (the
    # revision before's; none for PyTorch, whose host allocator saffu's import would set)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env["PYTHONPATH"], cwd = str(ROOT / "experiments"), ROOT
    if name == "saffu-before":
        env["PYTHONPATH"], cwd = os.pathsep.join([str(before.resolve()), env["PYTHONPATH"]]), before
    if name == "saffu-dp2":
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

    def command(*job) -> list[str]:     # child(name, spec, out[, process id, coordinator]) in a fresh Python
        arguments = ", ".join(map(repr, (name, str(spec_path), str(out), *job)))
        return [sys.executable, "-c", f"from bench_train import child; child({arguments})"]

    if name == "saffu-mp2":     # one process per core, joined by jax.distributed
        from saffu.engine.distributed import local_coordinator
        coordinator = local_coordinator()
        jobs = [subprocess.Popen(["taskset", "-c", core, *command(i, coordinator)], cwd=cwd, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for i, core in enumerate(cores.split(","))]
        done = [(job, *job.communicate()) for job in jobs]
        failed = [err for job, _, err in done if job.returncode]
    else:
        run = subprocess.run(["taskset", "-c", cores, *command()], cwd=cwd, env=env, capture_output=True, text=True)
        failed = [run.stderr] if run.returncode else []
    if failed:
        raise RuntimeError(f"{name} on cores {cores} failed:\n{failed[0][-3000:]}")
    return json.loads(out.read_text())


def _wanted(args, torch_ok: bool) -> list[tuple[str, str]]:
    rows = [(name, cores) for name, _, cores in VARIANTS]
    if args.variants:
        chosen = [v.split("@") for v in args.variants.split(",")]
        rows = [(n, c) for n, c in rows
                if any(n == w[0] and (len(w) == 1 or int(w[1]) == len(c.split(","))) for w in chosen)]
    if not args.before:
        rows = [r for r in rows if r[0] != "saffu-before"]
    if not torch_ok:
        rows = [r for r in rows if not r[0].startswith("torch")]
    if os.cpu_count() < 2:
        rows = [r for r in rows if r[1] == "0"]
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.vocab_size, args.width, args.layers, args.seq_len, args.batch_size = 2048, 64, 2, 64, 8
        args.steps, args.rounds, args.workdir = 3, 1, Path("/nonexistent")
    if args.before and not (args.before / "saffu" / "__init__.py").exists():
        raise SystemExit(f"--before {args.before}: no saffu/ package there (make one with `git worktree add DIR REV`)")
    try:
        import torch  # noqa: F401
        torch_ok = True
    except ImportError:
        torch_ok = False
        print("PyTorch is not installed (pip install -e '.[bench]'): its rows are left out")
    load_before = os.getloadavg()[0]
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        spec = _prepare(args, folder)
        rows = _wanted(args, torch_ok)
        runs: dict[tuple[str, str], list[dict]] = {row: [] for row in rows}
        for round_ in range(args.rounds):
            for name, cores in rows:
                result = _run_child(name, cores, spec, folder, args.before)
                runs[(name, cores)].append(result)
                print(f"round {round_ + 1}/{args.rounds} {name:>14} cores {cores:>3}: "
                      f"{result['seconds_per_step'] * 1e3:8.1f} ms/step, final loss {result['final_loss']:.5f}, "
                      f"{result['page_faults_per_step']:,.0f} page faults/step", flush=True)
        profile = (_run_child("saffu", "0", spec, folder, None, profile=True)["profile"]
                   if ("saffu", "0") in runs else [])
    figures = _figures(args, spec, runs, profile)
    load = {"load_average_1min_before": load_before, "load_average_1min_after": os.getloadavg()[0],
            "minutes": (time.time() - started) / 60}
    _print(figures, load)
    from saffu._io import write_metrics
    write_metrics(args.metrics_json, {k: v for k, v in figures.items() if isinstance(v, (int, float))})
    if args.write_result:
        from results import write_result
        print(f"wrote {write_result('bench_train', figures, seeds=[0], load=load)}")
    return 0


def _figures(args, spec: dict, runs: dict, profile: list[dict]) -> dict:
    tokens = args.batch_size * args.seq_len
    # XLA's cost analysis counts a loop's body once, and today's step runs its output layer and
    # attention in loops over chunks and windows: the count of the plain step (the revision
    # before, where it ran) is the model's whole computation
    counted = [r["xla_flops"] for name in ("saffu-before", "saffu") for (n, _), rs in runs.items() if n == name
               for r in rs if r.get("xla_flops")]
    flops = counted[0] if counted else None
    flops_from = next((n for n in ("saffu-before", "saffu") if any(k[0] == n for k in runs)), None)
    rows = []
    for (name, cores), results in runs.items():
        seconds = statistics.median(r["seconds_per_step"] for r in results)
        count = len(cores.split(","))
        rows.append({"variant": name, "cores": count, "seconds_per_step": seconds,
                     "seconds_per_step_rounds": [r["seconds_per_step"] for r in results],
                     "tokens_per_s": tokens / seconds, "tokens_per_s_per_core": tokens / seconds / count,
                     "gflops_per_s": flops / seconds / 1e9 if flops else None,
                     "own_xla_flops": results[0].get("xla_flops"),
                     "mean_train_loss": results[-1]["mean_train_loss"], "final_loss": results[-1]["final_loss"],
                     "page_faults_per_step": statistics.median(r["page_faults_per_step"] for r in results)})
    by = {(r["variant"], r["cores"]): r for r in rows}
    speed = lambda name, cores: by[(name, cores)]["tokens_per_s"] if (name, cores) in by else None
    ratio = lambda a, b: a / b if a and b else None
    torch_one = max((s for s in (speed("torch-eager", 1), speed("torch-compile", 1)) if s), default=None)
    two = max((s for s in (speed("saffu", 2), speed("saffu-dp2", 2), speed("saffu-mp2", 2)) if s), default=None)
    reference = by.get(("saffu", 1), {}).get("final_loss")
    return {"speedup_vs_before": ratio(speed("saffu", 1), speed("saffu-before", 1)),
            "speedup_vs_torch": ratio(speed("saffu", 1), torch_one),
            "speedup_two_cores": ratio(two, speed("saffu", 1)),
            "best_two_core_variant": max(((s, n) for n in ("saffu", "saffu-dp2", "saffu-mp2") if (s := speed(n, 2))),
                                         default=(None, None))[1],
            "max_final_loss_difference": max((abs(r["final_loss"] - reference) for r in rows), default=None)
            if reference is not None else None,
            "xla_flops_per_step": flops, "xla_flops_from": flops_from, "tokens_per_step": tokens,
            "model": {k: spec[k] for k in ("vocab_size", "width", "layers", "heads", "context", "batch_size",
                                           "seq_len")},
            "backend": spec["backend"], "data": spec["data"],
            "steps": {"warm": args.warm_steps, "timed": args.steps, "rounds": args.rounds},
            "rows": rows, "profile": profile}


def _print(figures: dict, load: dict) -> None:
    print(f"\n{'variant':>14} {'cores':>5} {'ms/step':>9} {'tokens/s':>9} {'per core':>9} {'GFLOP/s':>8} "
          f"{'train loss':>11} {'final loss':>11}")
    for r in figures["rows"]:
        gflops = f"{r['gflops_per_s']:8.1f}" if r["gflops_per_s"] else f"{'':>8}"
        print(f"{r['variant']:>14} {r['cores']:>5} {r['seconds_per_step'] * 1e3:9.1f} {r['tokens_per_s']:9,.0f} "
              f"{r['tokens_per_s_per_core']:9,.0f} {gflops} {r['mean_train_loss']:11.5f} {r['final_loss']:11.5f}")
    for key in ("speedup_vs_before", "speedup_vs_torch", "speedup_two_cores"):
        value = figures[key]
        print(f"{key}: {value:.2f}" if value else f"{key}: not measured")
    if figures["profile"]:
        print("\nsaffu's step, top ops (one core):")
        for p in figures["profile"]:
            print(f"  {p['ms_per_step']:7.1f} ms {p['share']:6.1%} {p['ops']:>3} × {p['kind']:>8} {p['shape']:>20}  "
                  f"{p['what'][:60]}")
    print(f"load: {load}")


if __name__ == "__main__":
    sys.exit(main())
