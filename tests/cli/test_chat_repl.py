"""``twinkle chat`` without ``--prompt``: a multi-turn conversation, interactive on a terminal
(streamed replies, ``/reset``, ``/exit``) and one question per line from a pipe."""

import io

from twinkle.cli import repl
from twinkle.cli.main import main


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _seen_prompts(monkeypatch):
    """Record the conversation each reply is generated from."""
    seen = []
    reply = repl.Conversation.reply

    def spy(self, prompt, stream=None):
        answer = reply(self, prompt, stream)
        seen.append([m["content"] for m in self.messages])
        return answer

    monkeypatch.setattr(repl.Conversation, "reply", spy)
    return seen


def test_terminal_conversation_keeps_history_resets_and_exits(tiny_model_dir, monkeypatch):
    seen = _seen_prompts(monkeypatch)
    stdin, stdout = _Terminal("hello\nagain\n/reset\nfresh\n/exit\nnever\n"), io.StringIO()
    code = repl.run_repl(str(tiny_model_dir), None, "sys", 3, "Template", stdin=stdin, stdout=stdout)
    assert code == 0
    out = stdout.getvalue()
    assert out.startswith(repl.HELP) and out.count(">>> ") == 5 and "(conversation reset)" in out
    assert [c[1::2] for c in seen] == [["hello"], ["hello", "again"], ["fresh"]]  # user turns
    assert all(c[0] == "sys" for c in seen)
    streamed = out.split(">>> ")[1].split("\n")[0]
    assert streamed.strip() == seen[0][2]  # the reply was streamed as generated


def test_piped_stdin_answers_line_by_line(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("first\n\nsecond\n"))
    assert main(["chat", "--model-id", str(tiny_model_dir), "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("> first\n") and "\n> second\n" in out and ">>> " not in out
