"""Side A of the ``contract`` workload: the verbatim contract script, timed from its log.

Run by ``bench/run.py`` as ``python bench/contract_side.py SPEC.json OUT.json``. It starts
``cookbook/transformers/fsdp2.py`` unchanged, with flags only for the data size, logging every
step and no evaluation, and stamps each ``Current is step k`` log line as it arrives: a step ends
when its line is written (after ``clip_grad_and_step`` and ``calculate_metric``), so data loading
and logging count, as on the Trainer side. The per-step counts come from the same pipeline run
here, and are checked against the tokens, supervised tokens and samples the script logs, so both
sides provably ran the same rows. Peak memory is the script process's own (``wait4``)."""

import ast
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (
    batch_record,
    build_dataset,
    log_step,
    lora_config,
    samples_digest,
    set_up_process,
    side_args,
    write_result,
)
from flops import model_shape
from twinkle_side import count_packed

from twinkle.dataloader import DataLoader
from twinkle.model import TransformersModel
from twinkle.processor import collate

SIDE = "twinkle"
SCRIPT = Path(__file__).resolve().parents[2] / "cookbook" / "transformers" / "fsdp2.py"
STEP_LINE = re.compile(r"Current is step (\d+) of (\d+), metric: (\{.*\})")


def _script_args(spec, output_dir: str) -> list[str]:
    args = [
        *("--train-samples", str(spec.num_samples), "--batch-size", str(spec.batch_size)),
        *("--max-length", str(spec.max_length), "--log-interval", "1"),
        *("--eval-interval", str(10**9), "--eval-samples", str(spec.batch_size)),
        *("--model-name", "Twinkle", "--model-author", "Acme", "--output-dir", output_dir),
        *("--seed", str(spec.seed)),
    ]
    if spec.model_path:
        args += ["--model-id", spec.model_path]
    if spec.dataset_id:
        args += ["--dataset-id", spec.dataset_id]
    return args


def main() -> None:
    spec, out = side_args()
    if spec.config != "contract":
        raise SystemExit("the contract workload runs the script's own defaults: --config contract")
    set_up_process(spec)
    dataset = build_dataset(spec)
    digest = samples_digest([dataset[i] for i in range(len(dataset))])
    records = []
    for batch in DataLoader(dataset=dataset, batch_size=spec.batch_size, world_size=1, rank=0):
        padded = collate(batch, dataset.pad_token_id)  # the rows as the script's model collates them
        record = batch_record(padded["input_ids"], padded["labels"], padded["attention_mask"], "supervised")
        count_packed(record, padded)
        records.append(record)

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="twinkle-contract-") as output_dir:
        start = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, str(SCRIPT), *_script_args(spec, output_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        previous = start
        for line in process.stdout:
            now = time.perf_counter()
            match = STEP_LINE.search(line)
            if not match:
                continue
            step, metric = int(match.group(1)), ast.literal_eval(match.group(3))
            record = records[step - 1]
            logged = (metric["samples"], metric["tokens"], metric["supervised_tokens"])
            if logged != (record.rows, record.tokens, record.supervised):
                raise SystemExit(
                    f"[{SIDE}] step {step}: the script logged {logged}, the pipeline gave "
                    f"{(record.rows, record.tokens, record.supervised)}"
                )
            record.loss, record.begin, record.end = float(metric["loss"]), previous, now
            previous = now
            log_step(SIDE, step - 1, spec, record)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise SystemExit(f"[{SIDE}] the contract script exited with {process.returncode}")
    done = [r for r in records if r.end]
    if len(done) != spec.total_steps:
        raise SystemExit(f"[{SIDE}] the script logged {len(done)} steps, expected {spec.total_steps}")
    # the parameter counts for the FLOPs columns, from the same model and adapter, once the
    # script is done (this process's memory is not what the table reports)
    model = TransformersModel(model_id=spec.model_path, dtype=spec.torch_dtype)
    model.add_adapter_to_model("default", lora_config(spec.train.lora_dropout))
    extra = {"peak_rss_mib": usage.ru_maxrss / 1024, "script": str(SCRIPT.relative_to(SCRIPT.parents[2]))}
    write_result(out, SIDE, spec, done, model_shape(model.model), digest, extra)


if __name__ == "__main__":
    main()
