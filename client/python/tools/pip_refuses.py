"""The build backend of client/python/pyproject.toml: it builds nothing.

The dmuon wheel holds a native extension and two daemon binaries that Bazel
builds; `./dmuon wheel` (make_wheel.py) packages them. A pip build here
would make a wheel without them, so every hook stops with that advice.
"""

_WHY = ("dmuon is not built by pip: run `./dmuon wheel` at the repository root "
        "(Bazel builds the extension and dmuond; make_wheel.py packages them into "
        "dist/), then `pip install dist/dmuon-*.whl`; or, from a source checkout, "
        "put client/python on PYTHONPATH after `bazel build //client/python:_dmuon.so "
        "//daemon:dmuond //daemon:dmuonctl` (client/python/README.md)")


def _refuse(*args, **kwargs):
    raise RuntimeError(_WHY)


get_requires_for_build_wheel = _refuse
get_requires_for_build_sdist = _refuse
get_requires_for_build_editable = _refuse
prepare_metadata_for_build_wheel = _refuse
prepare_metadata_for_build_editable = _refuse
build_wheel = _refuse
build_sdist = _refuse
build_editable = _refuse
