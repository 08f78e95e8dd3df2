"""Fixtures the training tests share."""

import pytest

from ..helpers.factories import make_image_folder


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    """A small class-per-folder image tree, made once per test module."""
    root = tmp_path_factory.mktemp("images")
    make_image_folder(root)
    return root
