"""``ClientMultiTurnRollout`` drives a ``twinkle_client``-shaped sampler (parameters as the
served dict); the package's place: ``twinkle`` never imports it, and importing it loads
neither Ray nor OpenSpiel nor ``twinkle_client``."""

import ast
import subprocess
import sys
from pathlib import Path

from twinkle.data_format import SamplingParams
from twinkle.sampler import TorchSampler
from twinkle_agentic.rollout import ClientMultiTurnRollout, MultiTurnRollout
from twinkle_agentic.tools import FunctionTool, ToolManager
from twinkle_client.sampler import SampledSequence, SampleResponse

SRC = Path(__file__).resolve().parents[2] / "src"


class ClientLikeSampler:
    """What ``twinkle_client.sampler.vLLMSampler.sample`` takes and returns, over a local
    sampler: a dict of the served parameters in, the client's dataclasses out."""

    def __init__(self, local: TorchSampler):
        self.local, self.seen = local, []

    def sample(self, rows, sampling_params):
        assert isinstance(sampling_params, dict)
        self.seen.append(sorted(sampling_params))
        out = []
        for response in self.local.sample(rows, SamplingParams(**sampling_params)):
            s = response.sequences[0]
            out.append(SampleResponse([SampledSequence(s.tokens, s.logprobs, s.stop_reason, None, {})]))
        return out


def test_client_rollout_equals_the_local_one(make_model, template):
    sampler = TorchSampler(make_model())
    params = SamplingParams(max_tokens=6, seed=1, temperature=1.0)
    manager = ToolManager([FunctionTool(lambda: "4", name="two_plus_two")])
    prompts = [{"messages": [{"role": "user", "content": "Who are you?"}]}] * 2
    local = MultiTurnRollout(sampler, template, manager, params)(prompts)
    sampler.reset_prefix_cache()  # the same kept rows on both sides: the same bits
    client_sampler = ClientLikeSampler(sampler)
    remote = ClientMultiTurnRollout(client_sampler, template, manager, params)(prompts)
    assert [r["input_ids"] for r in remote] == [r["input_ids"] for r in local]
    assert [r["old_logps"] for r in remote] == [r["old_logps"] for r in local]
    assert client_sampler.seen[0] == [
        "logprobs",
        "max_tokens",
        "num_samples",
        "seed",
        "temperature",
        "top_k",
        "top_p",
    ]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_twinkle_never_imports_twinkle_agentic():
    offenders = [p for p in (SRC / "twinkle").rglob("*.py") if "twinkle_agentic" in _imports(p)]
    assert not offenders, offenders


def test_importing_the_package_loads_no_optional_dependency():
    code = (
        "import sys, twinkle_agentic.envs, twinkle_agentic.tools, twinkle_agentic.rollout;"
        "print(sorted(m for m in ('ray', 'pyspiel', 'twinkle_client') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
