"""The environment stamp every result row carries, and the commit in it: right in a clone, a
worktree and a detached HEAD, "unknown" outside a checkout of this project, and a runner-supplied
hash checked."""

import os
import shutil
import subprocess
import sys

import pytest

from systems.measure import env
from systems.measure.env import REPO_ROOT


def test_git_commit_prefers_the_runner_supplied_hash(monkeypatch):
    # on the GPU machine the copied tree's .git can be stale; the runner states the real commit
    monkeypatch.setenv("WORKBOOK_GIT_COMMIT", "0123456789ab")
    assert env.git_commit() == "0123456789ab"
    monkeypatch.setenv("WORKBOOK_GIT_COMMIT", "0123456789ab+dirty")
    assert env.git_commit() == "0123456789ab+dirty"


def test_a_runner_supplied_value_that_is_not_a_hash_is_refused(monkeypatch):
    # the first bytes of a .git/HEAD file ("ref: refs/heads/main") were once stamped as a commit
    monkeypatch.setenv("WORKBOOK_GIT_COMMIT", "ref: refs/he")
    with pytest.raises(ValueError, match="not a commit hash"):
        env.git_commit()


def test_git_commit_reads_the_checkout_without_the_variable(monkeypatch):
    monkeypatch.delenv("WORKBOOK_GIT_COMMIT", raising=False)
    commit = env.git_commit()
    # "unknown" outside a git checkout (e.g. an unpacked archive); otherwise 12 hex digits, maybe dirty
    assert commit == env.UNKNOWN_COMMIT or len(commit.removesuffix("+dirty")) == 12


def _stamp_in(root, extra_env=None) -> str:
    """git_commit() as seen by a copy of the package at ``root``."""
    proc = subprocess.run([sys.executable, "-c", "from systems.measure.env import git_commit; print(git_commit())"],
                          cwd=root, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), **(extra_env or {})},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _git(*args, cwd):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def head():
    if shutil.which("git") is None or env.UNKNOWN_COMMIT == env.git_commit():
        pytest.skip("needs git and a checkout of this project")
    return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                          text=True).stdout.strip()


def test_stamp_is_right_in_a_clone_a_worktree_and_a_detached_head(tmp_path, head):
    clone = tmp_path / "clone"
    _git("clone", "-q", "--no-hardlinks", str(REPO_ROOT), str(clone), cwd=tmp_path)
    _git("checkout", "-q", head, cwd=clone)  # the clone's HEAD may be behind a dirty working copy's
    assert _stamp_in(clone) == head
    worktree = tmp_path / "worktree"
    _git("worktree", "add", "-q", "--detach", str(worktree), head, cwd=clone)  # a worktree, detached HEAD
    assert _stamp_in(worktree) == head
    (worktree / "README.md").write_text("changed\n")
    assert _stamp_in(worktree) == head + "+dirty"


def test_stamp_is_unknown_outside_a_checkout_of_this_project(tmp_path, head):
    other = tmp_path / "other"
    other.mkdir()
    _git("init", "-q", cwd=other)
    copy = other / "project"
    shutil.copytree(REPO_ROOT / "systems", copy / "systems", ignore=shutil.ignore_patterns("__pycache__"))
    _git("add", "-A", cwd=other)
    _git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "x", cwd=other)
    assert _stamp_in(copy) == env.UNKNOWN_COMMIT  # not the other repository's commit
    bare = tmp_path / "archive"
    shutil.copytree(REPO_ROOT / "systems", bare / "systems", ignore=shutil.ignore_patterns("__pycache__"))
    assert _stamp_in(bare) == env.UNKNOWN_COMMIT


def test_environment_names_the_software_and_the_dirty_flag(monkeypatch):
    stamp = env.environment()
    for key in ("torch", "git_commit", "date", "allow_dirty"):
        assert key in stamp


def test_environ_set_puts_back_what_was_there(monkeypatch):
    from systems.measure.env import environ_set

    monkeypatch.setenv("WORKBOOK_TEST_KEPT", "before")
    monkeypatch.delenv("WORKBOOK_TEST_UNSET", raising=False)
    with pytest.raises(RuntimeError):
        with environ_set({"WORKBOOK_TEST_KEPT": "inside", "WORKBOOK_TEST_UNSET": "inside"}):
            assert os.environ["WORKBOOK_TEST_KEPT"] == os.environ["WORKBOOK_TEST_UNSET"] == "inside"
            raise RuntimeError("the block fails: the values still go back")
    assert os.environ["WORKBOOK_TEST_KEPT"] == "before" and "WORKBOOK_TEST_UNSET" not in os.environ
