"""The `process` marker and the fast tier's guard (tests/conftest.py), on pytest runs of
their own (in this process: pytester's in-process runs start nothing)."""

from __future__ import annotations

import pathlib

import pytest

pytest_plugins = ["pytester"]

CONFTEST = pathlib.Path(__file__).with_name("conftest.py").read_text()
TESTS = '''
import subprocess
import sys

import pytest


@pytest.fixture
def temporal_server():  # a stand-in, by name: the real one starts a server
    return "127.0.0.1:7233"


def test_pure():
    assert sum([1, 2]) == 3


def test_on_a_service(temporal_server):
    assert temporal_server


@pytest.mark.e2e
def test_end_to_end():
    pass


def test_starts_a_process_unmarked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_forks_a_pool_unmarked():
    import multiprocessing
    with multiprocessing.get_context("fork").Pool(1) as pool:
        pool.map(abs, [-1])
'''


@pytest.fixture
def suite(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    e2e: e2e\n    process: process\n")
    pytester.makepyfile(test_suite=TESTS)
    return pytester


def test_a_test_on_a_service_fixture_or_marked_e2e_is_marked_process_at_collection(suite):
    result = suite.runpytest_inprocess("--collect-only", "-q", "-m", "process")
    result.stdout.fnmatch_lines(["*test_on_a_service*", "*test_end_to_end*",
                                 "*2/5 tests collected (3 deselected)*"])


def test_the_fast_tier_fails_an_unmarked_test_that_starts_a_process_naming_the_marker(suite):
    result = suite.runpytest_inprocess("-q", "-m", "not process")
    result.assert_outcomes(passed=1, failed=2, deselected=2)
    result.stdout.fnmatch_lines([
        "*test_starts_a_process_unmarked started a process (subprocess) but is not marked "
        "`process`: mark it @pytest.mark.process*",
        "*test_forks_a_pool_unmarked started a process (multiprocessing)*"])
