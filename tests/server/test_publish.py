"""Tinker's publishing (``RestClient.publish_checkpoint_from_tinker_path``): the owner publishes a
checkpoint, named by its ``tinker://`` or ``twinkle://`` path, and every key may then sample from
it and read its weights' info; unpublished, it is the owner's alone again. Only the owner
publishes, deletes or sets its TTL."""

import pytest
import tinker
from serving import KEY_A, KEY_B
from tinker import types

from twinkle_client.tinker_patch import patch_tinker


def test_a_published_checkpoint_is_readable_by_every_key_until_unpublished(server, tiny_model_dir):
    patch_tinker()  # twinkle:// paths in the RestClient, as init_tinker_client makes them
    owner = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    tc = owner.create_lora_training_client(
        base_model=str(tiny_model_dir), rank=4, train_unembed=False
    ).result()
    path = tc.save_weights_for_sampler("pub").result().path
    twinkle_path = path.replace("tinker://", "twinkle://")
    rest_a = tinker.RestClient(base_url=server.url, api_key=KEY_A)
    rest_b = tinker.RestClient(base_url=server.url, api_key=KEY_B)
    other = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    prompt = types.ModelInput.from_ints([5, 6, 7])
    params = types.SamplingParams(max_tokens=2, seed=1)

    with pytest.raises(tinker.NotFoundError):
        rest_b.get_weights_info_by_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError):  # only the owner publishes
        rest_b.publish_checkpoint_from_tinker_path(twinkle_path).result()
    rest_a.publish_checkpoint_from_tinker_path(twinkle_path).result()
    listed = rest_a.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.public for c in listed if c.tinker_path == path] == [True]
    assert rest_b.get_weights_info_by_tinker_path(path).result().lora_rank == 4
    sampler = other.create_sampling_client(model_path=path)
    assert len(sampler.sample(prompt, 1, params).result().sequences[0].tokens) == 2
    with pytest.raises(tinker.NotFoundError):  # publishing lends reading, not deleting
        rest_b.delete_checkpoint_from_tinker_path(path).result()

    rest_a.unpublish_checkpoint_from_tinker_path(path).result()
    assert not [c for c in rest_a.list_checkpoints(tc.model_id).result().checkpoints if c.public]
    with pytest.raises(tinker.NotFoundError):
        rest_b.get_weights_info_by_tinker_path(path).result()
