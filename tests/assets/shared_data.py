"""The small encoded self-cognition dataset the tests share (``dataset`` fixture, eval tests)."""

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.preprocessor import SelfCognitionProcessor


def build_dataset(model_dir, rows: int) -> Dataset:
    dataset = Dataset(DatasetMeta(None, data_slice=range(rows)))
    dataset.set_template("Template", model_id=str(model_dir), max_length=128)
    dataset.map(SelfCognitionProcessor("Twinkle", "Acme"))
    dataset.encode()
    return dataset
