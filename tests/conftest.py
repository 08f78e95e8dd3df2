"""Fixtures every test folder shares."""

import subprocess

import pytest


@pytest.fixture
def mount_small_disk(tmp_path):
    """``mount(size_bytes) -> folder``: a tmpfs of that size (a real filesystem that fills), unmounted after the
    test. Skips where tmpfs cannot be mounted (not root, or a container that forbids it); the same code paths are
    also tested with a writer that raises ENOSPC."""
    mounted = []

    def mount(size_bytes: int):
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)], capture_output=True
        )
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip() or 'mount failed'}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.fixture
def small_disk(mount_small_disk):
    """A 1 MB tmpfs (see :func:`mount_small_disk`)."""
    return mount_small_disk(1_000_000)
