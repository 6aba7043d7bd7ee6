"""Where a training step's memory goes under expert parallelism and under FSDP-only: the bytes
each module type saves for backward, on ``bench/moe_parallel.py``'s MoE at its sizes.

    python bench/moe_memory.py                     # EP 2 and FSDP-only on 2 gloo ranks
    python bench/moe_memory.py --sides ep --quick  # the tiny model, EP only: checks the script

Each side is a 2-rank torchrun job that builds the model, LoRA and optimizer as
``moe_parallel.py`` does, runs one untimed step (the optimizer state is made), then one step
under ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd keeps for the backward
is counted once (by its storage) against the innermost module running when it was saved
(forward hooks keep the module stack), or ``(outside modules)`` (the loss, by shape); inside an
experts module, PEFT's merged ``W + B @ A`` blocks are counted apart. ``--loss chunked`` runs
``ChunkedCrossEntropyLoss`` instead of the bench's default ``CrossEntropyLoss``. The resident set
around the step is read from ``/proc/self/status`` too. Rank 0's figures are printed, in MiB,
as a markdown table. Memory only: no timings."""

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import moe_parallel  # noqa: E402  (the bench's model, rows and sizes)
import torch  # noqa: E402

MIB = 1024 * 1024


class SavedBytes:
    """Bytes autograd saves for backward, by the innermost running module's class name."""

    def __init__(self, model):
        self.stack: list = []
        self.by_module: dict[str, int] = collections.Counter()
        self.seen: dict = {}  # storage address -> the saved tensor, weakly
        self.handles = []
        for module in model.modules():
            self.handles.append(module.register_forward_pre_hook(lambda m, a: self.stack.append(m)))
            self.handles.append(module.register_forward_hook(self.leave))

    def leave(self, module, args, output) -> None:
        self.stack.pop()  # returns None: the module's output stays its own

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        # an address whose saved tensor is gone (a branch autograd dropped) holds a new storage
        if (key not in self.seen or self.seen[key]() is None) and storage.nbytes():
            self.seen[key] = weakref.ref(tensor)
            self.by_module[self.label(tensor)] += storage.nbytes()
        return tensor

    def label(self, tensor) -> str:
        """The innermost module's class; inside an experts module, a tensor whose storage is
        a whole (experts, *weight) block of the size of its gate_up_proj or down_proj (PEFT's
        merged ``W + B @ A``, the module's own weight being a parameter, never saved as a copy)
        is told apart."""
        if not self.stack:
            return f"(outside modules: the loss) {tuple(tensor.shape)}"
        module = self.stack[-1]
        name = type(module).__name__
        weights = [getattr(module, w, None) for w in ("gate_up_proj", "down_proj")]
        sizes = {w.numel() * w.element_size() for w in weights if isinstance(w, torch.Tensor)}
        if tensor.untyped_storage().nbytes() in sizes:
            return f"{name}: merged expert weights"
        return name

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def status_mib(field: str) -> float:
    return moe_parallel.status_mib(field)


def worker(opts) -> None:
    import torch
    from peft import LoraConfig

    import twinkle
    from twinkle import DeviceMesh
    from twinkle.dataloader import collate
    from twinkle.model import TransformersModel

    mesh = DeviceMesh.from_sizes(fsdp_size=2, ep_size=opts.ep_size)
    runtime = twinkle.initialize(mode="local", global_device_mesh=mesh, timeout_s=1800, seed=42)
    torch.set_num_threads(1)
    fsdp_config = {"expert_parallel": {"enabled": True}} if opts.ep_size > 1 else None
    model = TransformersModel(
        model_id=opts.model_id, dtype=torch.float32, activation_checkpointing="off", fsdp_config=fsdp_config
    )
    layers = {type(m).__name__ for m in model.model.modules() if type(m).__name__.endswith("DecoderLayer")}
    model.model._no_split_modules = sorted(layers)
    torch.manual_seed(0)
    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=moe_parallel.EXPERTS,
    )
    model.add_adapter_to_model("default", lora)
    model.set_optimizer("AdamW", lr=1e-4, adapter_name="default")
    if opts.loss == "chunked":
        model.set_loss("ChunkedCrossEntropyLoss", adapter_name="default", chunk_size=256, reduction="sum")
    vocab = model.model.config.vocab_size
    batches = [
        collate(moe_parallel.random_rows(vocab, opts.rows, opts.seq, 1000 * step + mesh.data_rank), 0)
        for step in range(2)
    ]
    model.forward_backward(inputs=batches[0], adapter_name="default")
    model.clip_grad_and_step(adapter_name="default")
    before = status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    saved = SavedBytes(model.model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        model.forward_backward(inputs=batches[1], adapter_name="default")
    saved.remove()
    peak = status_mib("VmHWM")
    result = {
        "rank": runtime.rank,
        "rss_before_mib": before,
        "step_peak_mib": peak,
        "loss": type(model._group("default").loss_fn).__name__,
        "saved_mib": {k: v / MIB for k, v in sorted(saved.by_module.items(), key=lambda kv: -kv[1])},
    }
    Path(opts.result_dir, f"rank-{runtime.rank}.json").write_text(json.dumps(result))


def run_side(model_id: str, ep_size: int, shape: dict, loss: str) -> dict:
    result_dir = tempfile.mkdtemp(prefix="moe-memory-")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2"]
    argv += ["--master_addr", "127.0.0.1", "--master_port", str(moe_parallel.free_port()), str(HERE)]
    argv += ["--worker", "--model-id", model_id, "--result-dir", result_dir, "--ep-size", str(ep_size)]
    argv += ["--rows", str(shape["rows"]), "--seq", str(shape["seq"]), "--loss", loss]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(argv, env=env, cwd=moe_parallel.ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"ep_size={ep_size} failed:\n{(done.stdout + done.stderr)[-6000:]}")
    return json.loads((Path(result_dir) / "rank-0.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sides", default="fsdp,ep", help="comma-separated, of fsdp, ep")
    parser.add_argument("--quick", action="store_true", help="the tiny model: checks the script")
    parser.add_argument(
        "--loss",
        choices=("full", "chunked"),
        default="full",
        help="full: the default CrossEntropyLoss over the whole vocabulary's logits (as moe_parallel.py); "
        "chunked: ChunkedCrossEntropyLoss, 256 rows of logits at a time",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-id", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    parser.add_argument("--ep-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=256, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        worker(opts)
        import twinkle

        twinkle.runtime.shutdown()
        return
    size = "quick" if opts.quick else "full"
    folder = Path(tempfile.gettempdir()) / "twinkle-bench-models"
    folder.mkdir(parents=True, exist_ok=True)
    model_id = moe_parallel.build_moe(folder, size)
    shape = moe_parallel.EP_SHAPE[size]
    sides = {"fsdp": ("FSDP-only", 1), "ep": ("EP 2", 2)}
    results = {}
    for name in opts.sides.split(","):
        label, ep_size = sides[name]
        results[label] = run_side(model_id, ep_size, shape, opts.loss)
    modules = sorted({m for r in results.values() for m in r["saved_mib"]})
    modules.sort(key=lambda m: -max(r["saved_mib"].get(m, 0) for r in results.values()))
    lines = ["| saved for backward, MiB (rank 0) | " + " | ".join(results) + " |"]
    lines.append("|---|" + "---|" * len(results))
    for m in modules:
        lines.append(
            f"| {m} | " + " | ".join(f"{r['saved_mib'].get(m, 0):.1f}" for r in results.values()) + " |"
        )
    lines.append(
        "| total | " + " | ".join(f"{sum(r['saved_mib'].values()):.1f}" for r in results.values()) + " |"
    )
    lines.append(
        "| RSS before the step | " + " | ".join(f"{r['rss_before_mib']:.0f}" for r in results.values()) + " |"
    )
    lines.append(
        "| peak RSS in forward_backward | "
        + " | ".join(f"{r['step_peak_mib']:.0f}" for r in results.values())
        + " |"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
