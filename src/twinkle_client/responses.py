"""The values ``twinkle_client`` calls return, in upstream's shapes: a response whose ``result``
holds the value (``forward_only(...).result["logps"]``, ``calculate_metric().result``), a save's
``twinkle_path``, the train configs' ``model_dump()``."""

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Response:
    result: Any = None

    def model_dump(self) -> dict[str, Any]:
        return asdict(self)


class StepResult(float):
    """``forward_backward``'s mean loss per counted token (a float, as the local call returns),
    with upstream's ``result`` (``{"loss", "logps", "num_tokens"}``) beside it."""

    result: dict[str, Any]

    def __new__(cls, loss: float, result: dict[str, Any]) -> "StepResult":
        value = super().__new__(cls, loss)
        value.result = result
        return value


@dataclass
class SaveResponse:
    twinkle_path: str
    checkpoint_dir: str | None = None  # the server's folder is not shown to a client

    def model_dump(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TrainConfigs:
    result: str
    configs: dict[str, Any] = field(default_factory=dict)

    def model_dump(self) -> dict[str, Any]:
        return asdict(self)
