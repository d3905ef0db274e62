"""Fixtures: a real dmuond (started from the Bazel output, or $DMUON_DMUOND)
shared by a test module, and the import path of the dmuon package."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # client/python: the dmuon package
sys.path.insert(0, HERE)  # helpers

import dmuon  # noqa: E402


@pytest.fixture(scope="module")
def daemon():
    """A dmuond on 127.0.0.1 with a free port, for one test module."""
    d = dmuon.LocalDaemon(stop_grace=1.0)
    yield d
    d.stop()


@pytest.fixture
def fresh_daemon():
    """A dmuond of its own, for a test that kills or compares daemons."""
    d = dmuon.LocalDaemon(stop_grace=1.0)
    yield d
    d.stop()
