"""Nothing a request sends is misread: ``input_feature_to_datum`` means what the row means, and
every ``loss_fn_config`` key and ``loss_fn_inputs`` name is honoured or refused by name."""

import numpy as np
import pytest

from twinkle.server.common import input_feature_to_datum
from twinkle.server.errors import BadRequest
from twinkle.server.objectives import COMMON, TINKER_KEYS, UPSTREAM_DPO, build, check_config
from twinkle.server.wire import Datum


def test_input_feature_to_datum_shifts_once_and_weights_the_assistant_tokens():
    # a chat row: prompt 3 tokens (unlabelled), assistant 2 tokens, end token 9 labelled
    row = {"input_ids": [1, 2, 3, 7, 8, 9], "labels": [-100, -100, -100, 7, 8, 9]}
    datum = input_feature_to_datum(row)
    assert datum.model_input.to_ints() == [1, 2, 3, 7, 8]
    # position i predicts input_ids[i + 1]; trained where labels[i + 1] is not -100
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 7, 8, 9]
    assert datum.loss_fn_inputs["weights"].tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="same length"):
        input_feature_to_datum({"input_ids": [1, 2, 3], "labels": [1, 2]})


@pytest.mark.parametrize("loss_fn", sorted(TINKER_KEYS))
def test_each_tinker_loss_honours_its_keys_and_refuses_any_other(loss_fn):
    for key in TINKER_KEYS[loss_fn]:
        check_config(loss_fn, {key: 0.9}, forward_only=False, composite=False)
    check_config(loss_fn, {"disable_lora": 1.0}, forward_only=True, composite=False)
    with pytest.raises(BadRequest, match="'bogus' is not read"):
        check_config(loss_fn, {"bogus": 1.0}, forward_only=False, composite=False)
    with pytest.raises(BadRequest, match="disable_lora.*would train nothing"):
        check_config(loss_fn, {"disable_lora": 1.0}, forward_only=False, composite=False)
    with pytest.raises(BadRequest, match="twinkle_count"):
        check_config(loss_fn, {"twinkle_count": 3.0}, forward_only=False, composite=False)


def test_twinkle_losses_take_their_constructor_arguments_only():
    loss = build("cross_entropy", {"twinkle_loss": "DPOLoss", "beta": 0.2, "loss_type": "ipo"})
    assert loss.beta == 0.2 and loss.loss_type == "ipo"
    with pytest.raises(BadRequest, match="DPOLoss takes no argument 'gamma'"):
        build("cross_entropy", {"twinkle_loss": "DPOLoss", "gamma": 1.0})
    with pytest.raises(BadRequest, match="unknown loss 'Nope'"):
        build("cross_entropy", {"twinkle_loss": "Nope"})
    upstream = build("importance_sampling", {"dpo_beta": 0.3, "dpo_sft_weight": 1.0})
    assert upstream.beta == 0.3 and upstream.sft_weight == 1.0
    with pytest.raises(BadRequest, match="'beta' is not read by the DPO loss"):
        check_config("importance_sampling", {"beta": 0.3}, forward_only=False, composite=True)
    for key in (*UPSTREAM_DPO, *COMMON[:1]):
        check_config("importance_sampling", {key: 0.1} if key in UPSTREAM_DPO else {}, False, True)


def test_every_tinker_loss_the_sdk_names_is_served_or_refused(server):
    """The SDK's ``LossFnType`` and ``ForwardBackwardInput`` fields, enumerated: each loss is
    one the server computes or a refusal naming it, and no field of the request is unread."""
    import typing

    from tinker import types

    from twinkle.server.datums import LOSS_INPUTS
    from twinkle.server.routes.training import check_datums

    names = typing.get_args(types.LossFnType)
    datum = Datum(
        np.array([1, 2, 3]), {"target_tokens": np.array([2, 3, 4]), "weights": np.ones(3, np.float32)}
    )
    for name in names:
        if name in LOSS_INPUTS:
            continue
        with pytest.raises(BadRequest, match=f"loss_fn {name!r} is not supported"):
            check_datums([datum], name, 100)
    fields = set(types.ForwardBackwardInput.__annotations__)
    assert fields <= {"data", "loss_fn", "loss_fn_config"}, fields - {"data", "loss_fn", "loss_fn_config"}
    extra = Datum(datum.tokens, {**datum.inputs, "mask": np.ones(3, np.float32)})
    with pytest.raises(BadRequest, match="'mask' is not read by loss_fn 'cross_entropy'"):
        check_datums([extra], "cross_entropy", 100)
