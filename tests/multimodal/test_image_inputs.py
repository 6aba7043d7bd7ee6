"""``Message.images``: each image read from a path, bytes, a PIL image or a ``datasets`` image
record; URLs, missing and undecodable images, and ``<image>`` tags without an image are one
line naming the row and the image. Images go where the user turns write ``<image>``."""

import pytest
from PIL import Image

from twinkle.template.images import BadImage, load_image, place_images


def test_every_local_form_reads_to_the_same_rgb_image(tmp_path, png):
    data = png(size=(20, 12), colour=(10, 200, 30))
    path = tmp_path / "a.png"
    path.write_bytes(data)
    rgba = Image.new("RGBA", (20, 12), (10, 200, 30, 255))
    forms = [str(path), path, data, bytearray(data), rgba, {"bytes": data, "path": None}, {"path": str(path)}]
    images = [load_image(form) for form in forms]
    assert all(im.mode == "RGB" and im.size == (20, 12) for im in images)
    assert {im.getpixel((3, 3)) for im in images} == {(10, 200, 30)}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (
            "https://example.com/cat.png",
            r"messages\[0\].images\[1\] is a URL \(https://example.com/cat.png\); .*nothing is downloaded",
        ),
        ("/no/such/dir/cat.png", r"messages\[0\].images\[1\]: no such image file '/no/such/dir/cat.png'"),
        (b"not an image at all", r"messages\[0\].images\[1\] \(19 bytes\) cannot be decoded as an image"),
        (3.5, r"messages\[0\].images\[1\] is a number \(3.5\); give a file path"),
    ],
)
def test_an_image_that_cannot_be_read_is_one_line_naming_the_row(value, says, png):
    messages = [{"role": "user", "content": "<image><image>which?", "images": [png(), value]}]
    with pytest.raises(BadImage, match=f"^row 7: {says}") as info:
        place_images(messages, index=7)
    assert "\n" not in str(info.value)
    assert (info.value.index, info.value.field) == (7, "messages[0].images[1]")


def test_a_truncated_file_is_undecodable(tmp_path, png):
    path = tmp_path / "cut.png"
    path.write_bytes(png(size=(64, 64))[:60])
    with pytest.raises(BadImage, match=r"cut.png'\) cannot be decoded"):
        load_image(str(path), 0, "messages[0].images[0]")


def test_more_tags_than_images_names_the_row():
    messages = [
        {"role": "user", "content": "<image>and<image>?", "images": [Image.new("RGB", (8, 8))]},
        {"role": "assistant", "content": "two"},
    ]
    with pytest.raises(
        BadImage, match=r"^row 4: the user turns have 2 <image> tag\(s\) but the row gives 1 image\(s\)"
    ):
        place_images(messages, index=4)


def test_images_fill_the_tags_in_turn_order_and_extra_images_lead_the_first_user_turn():
    red, green, blue = (Image.new("RGB", (8, 8), c) for c in ("red", "green", "blue"))
    messages = [
        {"role": "system", "content": "Look."},
        {"role": "user", "content": "A<image>B", "images": [red, green]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "<image>C", "images": [blue]},
    ]
    turns, images = place_images(messages)
    # three images, two tags: the untagged one goes first in the first user turn
    assert turns[1]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "A"},
        {"type": "image"},
        {"type": "text", "text": "B"},
    ]
    assert turns[3]["content"] == [{"type": "image"}, {"type": "text", "text": "C"}]
    assert turns[0]["content"] == [{"type": "text", "text": "Look."}]
    assert [im.getpixel((0, 0)) for im in images] == [(255, 0, 0), (0, 128, 0), (0, 0, 255)]
    assert all("images" not in t for t in turns)


def test_a_row_without_images_keeps_its_text():
    turns, images = place_images([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert images == [] and turns[0]["content"] == [{"type": "text", "text": "hi"}]
