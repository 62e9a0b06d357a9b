"""Where `tsave -r` may write: only inside the save directory chosen at start-up."""

import pytest

from kgtp_sim.tracing.core.tfile import SavePathError, resolve_save_path


def test_relative_and_absolute_paths_inside(tmp_path):
    assert resolve_save_path(tmp_path, "a.tf") == tmp_path.resolve() / "a.tf"
    assert resolve_save_path(tmp_path, str(tmp_path / "sub" / "b.tf")) == tmp_path.resolve() / "sub" / "b.tf"


@pytest.mark.parametrize("name", ["../x.tf", "/etc/passwd", "sub/../../x.tf", "", ".", "a\0b"])
def test_escapes_are_refused(tmp_path, name):
    with pytest.raises(SavePathError):
        resolve_save_path(tmp_path, name)


def test_symlink_out_of_the_directory_is_refused(tmp_path):
    inside = tmp_path / "saves"
    inside.mkdir()
    (inside / "link").symlink_to(tmp_path)
    with pytest.raises(SavePathError):
        resolve_save_path(inside, "link/x.tf")


def test_no_save_dir_refuses_everything():
    with pytest.raises(SavePathError, match="--save-dir"):
        resolve_save_path(None, "x.tf")
