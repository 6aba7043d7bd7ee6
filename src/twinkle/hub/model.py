"""``resolve_model``: a model id to a local folder that ``from_pretrained`` can load."""

from pathlib import Path

from twinkle.hub.check_folder import check_model_folder
from twinkle.hub.gguf import BUNDLED_MODEL_NAMES, bundled_gguf_path, resolve_gguf
from twinkle.hub.remote import looks_like_hub_id, snapshot
from twinkle.utils.errors import UserError

_HINT = "pass a folder with config.json, a .gguf file, or a hub id like hf://org/name"


def _local_model(path: Path, name: str) -> Path:
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UserError(f"model {name!r} is a file but not a .gguf file; {_HINT}")
        return resolve_gguf(path)
    if (path / "config.json").is_file():
        check_model_folder(path, name)
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return resolve_gguf(ggufs[0])
    found = f"{len(ggufs)} .gguf files" if ggufs else "no config.json"
    raise UserError(f"model folder {name!r} has {found}; {_HINT}")


def resolve_model(model_id: str | None) -> Path:
    """Return a local folder for ``model_id`` loadable by ``AutoModelForCausalLM.from_pretrained``.

    - ``None``, ``'SmolLM2-135M-Instruct'``, ``'HuggingFaceTB/SmolLM2-135M-Instruct'`` or
      ``'twinkle://SmolLM2-135M-Instruct'``: the bundled GGUF model, converted once into the
      twinkle cache (``$TWINKLE_CACHE`` or ``~/.cache/twinkle``).
    - a local ``.gguf`` file (or a folder holding exactly one): converted once likewise.
    - a local folder with ``config.json``: that folder.
    - ``hf://org/name``, ``ms://org/name`` or a bare ``org/name`` that is not a local path: the
      hub's local cache, else a download when the network is allowed.

    A folder from the user (local or a hub snapshot) passes ``check_model_folder`` first: its
    config, tokenizer files and weights are checked before transformers reads them. A GGUF file
    is checked for an architecture transformers can convert.

    Raises ``UserError`` naming the id when none of these works."""
    if model_id is None or model_id in BUNDLED_MODEL_NAMES:
        return resolve_gguf(bundled_gguf_path())
    if model_id.startswith("twinkle://"):
        names = ", ".join(sorted(BUNDLED_MODEL_NAMES))
        raise UserError(f"unknown bundled model {model_id!r}; bundled models are: {names}")
    path = Path(model_id).expanduser()
    if path.exists():
        return _local_model(path.resolve(), model_id)
    if looks_like_hub_id(model_id):
        return _local_model(snapshot(model_id, "model"), model_id)
    raise UserError(f"model path {model_id!r} does not exist; {_HINT}")
