"""Runs ``cookbook/rl/grpo_math.py`` as it is, recording what its loop samples (``test_ray_cookbooks``).

    python grpo_recorder.py OUT.json SCRIPT_ARGS...

Two things are set up before the script runs, in this process only (the driver, which runs the
loop in both modes):

- every training ``sample`` call's token ids (one list per completion, in order) go to
  ``OUT.json``, whether the sampler is local (``TorchSampler.sample``) or on a device group (the
  driver's proxy call);
- ``GSM8KFormatReward`` is replaced by a reward of the completion's characters (``VariedReward``):
  the tiny model's completions are noise that the real rewards score 0 throughout, so every
  advantage, loss and gradient would be 0 and two runs would agree trivially."""

import json
import runpy
import sys
from pathlib import Path

import twinkle.reward
from twinkle.reward import Reward
from twinkle.runtime.remote import RemoteObject
from twinkle.sampler import TorchSampler

SCRIPT = Path(__file__).resolve().parents[2] / "cookbook" / "rl" / "grpo_math.py"
SAMPLED: list[list[list[int]]] = []  # per training sample call: each completion's token ids


class VariedReward(Reward):
    """0, 0.25, ..., 1 by the completion's characters: a function of the sampled tokens alone."""

    name = "format"

    def score(self, completion, trajectory) -> float:
        return (sum(map(ord, completion)) % 5) / 4


def _note(responses, params) -> None:
    if params is not None and getattr(params, "temperature", 1) != 0:  # greedy ones are the evaluation
        SAMPLED.append([list(s.tokens) for r in responses for s in r.sequences])


def _local_sample(self, inputs, sampling_params=None, *args, **kwargs):
    responses = _plain_sample(self, inputs, sampling_params, *args, **kwargs)
    _note(responses, sampling_params)
    return responses


def _remote_call(self, name, *args, **kwargs):
    value = _plain_call(self, name, *args, **kwargs)
    if name == "sample":
        _note(value, args[1] if len(args) > 1 else kwargs.get("sampling_params"))
    return value


_plain_sample, _plain_call = TorchSampler.sample, RemoteObject._call


def main() -> None:
    out = Path(sys.argv[1])
    TorchSampler.sample = _local_sample
    RemoteObject._call = _remote_call
    twinkle.reward.GSM8KFormatReward = VariedReward
    sys.argv = [str(SCRIPT), *sys.argv[2:]]
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        out.write_text(json.dumps(SAMPLED))


if __name__ == "__main__":
    main()
