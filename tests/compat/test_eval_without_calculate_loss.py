"""An evaluation loop in upstream's Megatron cookbook shape (``forward_only`` per batch, then
``calculate_metric(is_training=False)``, no ``calculate_loss``) reports every batch, the same
numbers as the loop that calls ``calculate_loss`` after each; each batch counts once."""

ROWS = [
    {
        "messages": [
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": "I am Twinkle."},
        ]
    },
    {"messages": [{"role": "user", "content": "Your name?"}, {"role": "assistant", "content": "Twinkle"}]},
    {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there, friend."},
        ]
    },
]


def _eval(model, with_calculate_loss: bool) -> dict:
    for batch in (ROWS[:2], ROWS[2:], ROWS[:1]):
        model.forward_only(inputs=batch)
        if with_calculate_loss:
            model.calculate_loss()
    return model.calculate_metric(is_training=False)


def test_batches_are_reported_without_calculate_loss(make_model):
    model = make_model()
    explicit, implicit = _eval(model, True), _eval(model, False)
    assert implicit["samples"] == explicit["samples"] == 4
    assert implicit["loss"] == explicit["loss"] and implicit["accuracy"] == explicit["accuracy"]
    assert model.calculate_metric(is_training=False).get("samples", 0) == 0  # nothing counted twice


def test_a_reference_pass_is_not_an_evaluation(make_model):
    model = make_model()
    model.forward_only(inputs=ROWS, disable_lora=True)
    assert model.calculate_metric(is_training=False).get("samples", 0) == 0
