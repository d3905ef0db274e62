"""The build's version is written once, in base/protocol.h (kDmuonVersion):
the extension's __version__ (module.cc), the package's and the wheel's
(make_wheel.py) are all read from it."""

import importlib.util
import os
import re

import dmuon

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def protocol_h_version():
    with open(os.path.join(ROOT, "base", "protocol.h")) as f:
        m = re.search(r'kDmuonVersion\[\] = "([^"]+)"', f.read())
    assert m, "base/protocol.h defines kDmuonVersion"
    return m.group(1)


def test_the_extension_reports_base_protocol_h_version():
    assert dmuon.__version__ == protocol_h_version()
    assert dmuon._ext.__version__ == protocol_h_version()


def test_the_wheel_takes_base_protocol_h_version():
    path = os.path.join(ROOT, "client", "python", "make_wheel.py")
    spec = importlib.util.spec_from_file_location("make_wheel", path)
    make_wheel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_wheel)
    _, tool = make_wheel.project()
    assert make_wheel.version(tool) == protocol_h_version()
