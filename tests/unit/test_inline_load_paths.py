"""The `file:<path>` parameters of a load that carries its model folder: Triton reads `file:/1/model.py`
as the folder's 1/model.py (its QA suite's model-control tests write it so); nothing may leave the folder."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from server.errors import InvalidInputError
from server.repository.inline_load import _file_path


@pytest.mark.parametrize("text", ["1/model.py", "/1/model.py", "//1/model.py"])
def test_a_leading_slash_names_the_model_folder(text):
    assert _file_path("m", text) == PurePosixPath("1/model.py")


@pytest.mark.parametrize("text", ["/../x/1/model.py", "../x", "/", ""])
def test_paths_that_leave_the_folder_or_name_nothing_are_refused(text):
    with pytest.raises(InvalidInputError, match="must be a relative path inside the model folder"):
        _file_path("m", text)
