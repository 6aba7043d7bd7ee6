"""``twinkle server``'s command line: every flag documented, bad setup is one ``error:`` line."""

import pytest

from twinkle.cli.main import main
from twinkle.server.config import build_parser, parse_args
from twinkle.utils.errors import UserError

FLAGS = [
    "--model-id",
    "--host",
    "--port",
    "--max-loras",
    "--max-r",
    "--output-dir",
    "--api-keys",
    "--idle-timeout",
    "--report-to",
    "--mode",
    "--model-ranks",
    "--sampler-ranks",
    "--ray-address",
]


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as done:
        main(["server", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for action in build_parser()._actions:
        for flag in action.option_strings:
            assert flag in out
    assert all(flag in out for flag in FLAGS)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "server" in capsys.readouterr().out


def test_no_key_off_loopback_is_one_error_line(monkeypatch, capsys):
    monkeypatch.delenv("TWINKLE_API_KEYS", raising=False)
    assert main(["server", "--host", "0.0.0.0", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("error: --host 0.0.0.0 without API keys")


def test_no_key_on_loopback_is_one_local_user(monkeypatch):
    monkeypatch.delenv("TWINKLE_API_KEYS", raising=False)
    config = parse_args([])
    assert config.keyless and config.host == "127.0.0.1" and len(config.keys) == 1


def test_key_file_with_limits(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# tenants\ntml-a max_adapters=2 rate=5\ntml-b\n")
    config = parse_args(["--api-keys", str(keys), "--max-datums", "7"])
    assert config.keys["tml-a"].max_adapters == 2 and config.keys["tml-a"].rate == 5.0
    assert config.keys["tml-b"].max_datums == 7
    keys.write_text("tml-a speed=9\n")
    with pytest.raises(UserError, match=r"keys:1: unknown limit 'speed'"):
        parse_args(["--api-keys", str(keys)])
    keys.write_text("tml-a\nsecret\n")
    with pytest.raises(UserError, match=r"keys:2: an API key must start with 'tml-'"):
        parse_args(["--api-keys", str(keys)])
    with pytest.raises(UserError, match="cannot read it"):
        parse_args(["--api-keys", str(tmp_path / "missing")])
