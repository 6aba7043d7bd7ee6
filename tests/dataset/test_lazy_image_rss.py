"""``LazyDataset`` never holds an image set in memory: a thousand image rows read through the
template and the ``DataLoader`` leave the process's peak memory where the first batches put it.

Each measurement runs in a fresh process (this file run as a script) so that nothing the test
session allocated counts. The process reads ``WARM`` rows first (imports, the processor, the
allocator's arenas: costs paid once), takes the peak resident set size, reads the other rows and
takes the peak again. ``decoded`` is what those other rows' images take decoded, at PIL's
smallest (3 bytes a pixel; PIL keeps RGB in 4): a reader that kept them would raise the peak by
at least that. The claim tested is that fewer than a tenth of them are ever in memory at once,
so the peak may grow by less than ``decoded / 10``; a streaming reader holds one batch (8 of
1,000 rows, 0.8%). A control run over the first 1,000 rows keeps every image it decodes and
must raise the peak by at least a quarter of what the kept images take decoded (234 MiB): the
measurement sees images that stay in memory (not all of it: the allocator hands pages the warm
rows freed to the kept images). The two runs go on at once, a process each."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROWS, WARM, BATCH = 1200, 200, 8  # 1,000 rows read after the warm ones: 293 MiB of images decoded
SIDE = 320  # 320x320 RGB: 300 KiB decoded at 3 bytes a pixel; resized by the processor to 64x64
KEPT_EVERY, CONTROL_ROWS = 1, 1000  # the control keeps every image of the first 1,000 rows


def _write_rows(folder: Path) -> Path:
    """``ROWS`` PNGs, each one colour (small on disk, quick to write and read) and
    ``SIDE`` x ``SIDE`` decoded, and a JSONL of one question per image."""
    from PIL import Image

    images = folder / "images"
    images.mkdir()
    lines = []
    for i in range(ROWS):
        path = images / f"{i}.png"
        Image.new("RGB", (SIDE, SIDE), (i % 256, 7 * i % 256, 13 * i % 256)).save(path, compress_level=1)
        user = {"role": "user", "content": "<image>Which colour?", "images": [str(path)]}
        lines.append(json.dumps({"messages": [user, {"role": "assistant", "content": f"colour {i}"}]}))
    rows = folder / "rows.jsonl"
    rows.write_text("\n".join(lines) + "\n")
    return rows


def _peak_bytes() -> int:
    """This process's own peak (``VmHWM``): ``ru_maxrss`` starts at the test session's peak,
    carried across ``exec``, and then shows no growth at all."""
    from twinkle.utils.memory import peak_rss_mib

    return int(peak_rss_mib() * 2**20)


def _read(rows: str, model_dir: str, count: int, keep_every: int) -> dict:
    """Read the first ``count`` rows through ``LazyDataset`` -> ``Qwen2_5VLTemplate`` ->
    ``DataLoader``; with ``keep_every`` > 0, hold on to every ``keep_every``-th decoded image."""
    from twinkle.dataloader import DataLoader
    from twinkle.dataset import DatasetMeta, LazyDataset
    from twinkle.template import images as images_module

    kept = []
    if keep_every:
        load_image = images_module.load_image

        def keeping(*args, **kwargs):
            image = load_image(*args, **kwargs)
            if len(kept) * keep_every <= read["images"]:
                kept.append(image)
            read["images"] += 1
            return image

        images_module.load_image = keeping
    read = {"images": 0, "rows": 0, "patches": 0}
    dataset = LazyDataset(DatasetMeta(rows, data_slice=range(count)))
    dataset.set_template("Qwen2_5VLTemplate", model_id=model_dir, max_length=256)
    dataset.encode()
    peaks = {}
    for batch in DataLoader(dataset=dataset, batch_size=BATCH):
        read["rows"] += len(batch)
        read["patches"] += sum(len(row["pixel_values"]) for row in batch)
        if read["rows"] == WARM:
            peaks["warm"] = _peak_bytes()
    return {**read, "warm_peak": peaks["warm"], "peak": _peak_bytes(), "kept": len(kept)}


def _start(rows: Path, model_dir: Path, count: int, keep_every: int = 0) -> subprocess.Popen:
    argv = [sys.executable, __file__, str(rows), str(model_dir), str(count), str(keep_every)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _measured(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow  # 1,200 images written, read by two fresh processes at once
def test_image_rows_are_read_one_batch_at_a_time(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multimodal"))
    from tiny_vl import build_tiny_vl  # the tiny random Qwen2.5-VL (max 64x64 pixels an image)

    model_dir = build_tiny_vl(tmp_path / "tiny-vl")
    rows = _write_rows(tmp_path)
    decoded = (ROWS - WARM) * SIDE * SIDE * 3

    # both measurements at once, a process each (each reads its own peak)
    streamed_run = _start(rows, model_dir, ROWS)
    control_run = _start(rows, model_dir, CONTROL_ROWS, keep_every=KEPT_EVERY)
    streamed, control = _measured(streamed_run), _measured(control_run)
    assert streamed["rows"] == ROWS and streamed["patches"] == ROWS * 256  # every row encoded
    growth = streamed["peak"] - streamed["warm_peak"]
    assert growth < decoded / 10, (
        f"reading {ROWS - WARM} more image rows raised the peak RSS by {growth / 2**20:.0f} MiB; "
        f"their images take {decoded / 2**20:.0f} MiB decoded"
    )

    assert control["kept"] == CONTROL_ROWS // KEPT_EVERY
    held = control["peak"] - control["warm_peak"]
    kept = (CONTROL_ROWS - WARM) // KEPT_EVERY * SIDE * SIDE * 3  # kept after the warm rows
    assert held > kept / 4, (
        f"keeping {control['kept']} images raised the peak by only {held / 2**20:.0f} MiB of "
        f"{kept / 2**20:.0f} MiB: the measurement does not see held images"
    )


if __name__ == "__main__":  # one measurement in a fresh process: rows, model folder, count, keep_every
    print(json.dumps(_read(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
