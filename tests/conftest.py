"""Session fixtures for the real services: Temporal dev server and SeaweedFS S3; and the
`process` marker of every test that starts a process or a service, with the fast tier's
guard (`make test-fast`: -m 'not soak and not process') that fails a test which starts
one unmarked."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Fixtures that start a service or a process: a test that requests one (or a fixture that
# does) starts processes, and is marked at collection.
PROCESS_FIXTURES = frozenset({"temporal_server", "seaweed", "s3_env", "fleet_factory"})
# Markers that say so already: an end-to-end test runs real processes by definition.
PROCESS_MARKERS = frozenset({"process", "e2e"})
# A backend parameter of this value: the test asks for SeaweedFS (request.getfixturevalue,
# which collection cannot see), its `file` twin does not.
PROCESS_PARAMS = frozenset({"s3"})
# Tests that start processes in modules that carry no mark of their own (node ids, or
# their prefix before the parameters).
PROCESS_TESTS = frozenset({
    "tests/ops/test_cli_events.py::",
    "tests/ops/test_cli_events_follow.py::test_follow_ends_on_a_run_whose_last_two_events_share_their_time",
})


def starts_processes(item: pytest.Item) -> bool:
    """Pure: whether a collected test is known to start a process or a service."""
    callspec = getattr(item, "callspec", None)
    params = set(map(str, callspec.params.values())) if callspec is not None else set()
    return bool(PROCESS_FIXTURES & set(getattr(item, "fixturenames", ()))) or any(
        item.get_closest_marker(name) is not None for name in PROCESS_MARKERS) or bool(
        PROCESS_PARAMS & params) or any(item.nodeid.startswith(t) for t in PROCESS_TESTS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if starts_processes(item) and item.get_closest_marker("process") is None:
            item.add_marker(pytest.mark.process)


class UnmarkedProcessStart(RuntimeError):
    """A test not marked `process` started one (where the guard is on)."""

    def __init__(self, nodeid: str, what: str) -> None:
        super().__init__(
            f"{nodeid} started a process ({what}) but is not marked `process`: mark it "
            "@pytest.mark.process (module: pytestmark = pytest.mark.process), or have it "
            "request a fixture that starts one (tests/conftest.py PROCESS_FIXTURES), so "
            "that the fast tier (`make test-fast`, -m 'not process') leaves it out")
        self.nodeid, self.what = nodeid, what


def guard_on(config: pytest.Config) -> bool:
    """The guard is on in a run that leaves `process` tests out: the fast tier."""
    return "not process" in " ".join((config.getoption("markexpr", "") or "").split())


# The ways a test starts a process: subprocess (and asyncio's, which uses it), fork and
# spawn (multiprocessing, torch's, concurrent.futures' pools). Not os.system: the pickle
# payloads of the safe-loading tests name it, and a stand-in in its place cannot be pickled.
_GUARDED = (
    (subprocess.Popen, "_execute_child", "subprocess"),
    (multiprocessing.process.BaseProcess, "start", "multiprocessing"),
    (os, "fork", "os.fork"),
    (os, "forkpty", "os.forkpty"),
    (os, "posix_spawn", "os.posix_spawn"),
    (os, "posix_spawnp", "os.posix_spawnp"),
)


def _refuse(nodeid: str, what: str):
    def refused(*args, **kwargs):
        raise UnmarkedProcessStart(nodeid, what)
    return refused


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """Setup, call and teardown of an unmarked test (its module fixtures' set-up
    included) with every process start refused, where the guard is on."""
    if not guard_on(item.config) or item.get_closest_marker("process") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        for owner, name, what in _GUARDED:
            if hasattr(owner, name):
                patch.setattr(owner, name, _refuse(item.nodeid, what))
        yield


@pytest.fixture(scope="session")
def temporal_server(tmp_path_factory):
    from ops.services import TemporalDevServer, free_port

    server = TemporalDevServer(str(tmp_path_factory.mktemp("temporal")), port=free_port(),
                               headless=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    from ops.services import SeaweedS3

    s3 = SeaweedS3(str(tmp_path_factory.mktemp("seaweedfs"))).start()
    yield s3
    s3.stop()


@pytest.fixture
def s3_env(seaweed, monkeypatch):
    """Point this process (and the workers it starts) at the SeaweedFS S3 gateway."""
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    return seaweed.env()
