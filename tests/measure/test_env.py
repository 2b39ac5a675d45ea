"""The environment stamp every result row carries."""

from systems.measure import env


def test_git_commit_prefers_the_runner_supplied_hash(monkeypatch):
    # on the GPU machine the copied tree's .git can be stale; the runner states the real commit
    monkeypatch.setenv("WORKBOOK_GIT_COMMIT", "0123456789ab")
    assert env.git_commit() == "0123456789ab"


def test_git_commit_reads_the_checkout_without_the_variable(monkeypatch):
    monkeypatch.delenv("WORKBOOK_GIT_COMMIT", raising=False)
    commit = env.git_commit()
    # None outside a git checkout (e.g. an sdist); otherwise a 12-digit hash, maybe marked dirty
    assert commit is None or len(commit.removesuffix("+dirty")) == 12


def test_environment_names_the_software():
    stamp = env.environment()
    for key in ("torch", "git_commit", "date"):
        assert key in stamp
