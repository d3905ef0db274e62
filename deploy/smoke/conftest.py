"""Fixtures of the image smoke test: the images under test ($DMUON_IMAGE,
$DMUON_CUDA_IMAGE: the ids of the images `./dmuon image` printed, and
$DMUON_IMAGE_REF, the CPU image's reference; smoke.sh sets them),
the import paths of the dmuon package and of the client tests' oracle
helpers (client/python/tests: helpers.py, torch_ref.py), which this test
reuses rather than copies."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "client" / "python"))
sys.path.insert(0, str(ROOT / "client" / "python" / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _image(var: str) -> str:
    ref = os.environ.get(var, "")
    if not ref:
        pytest.fail(f"${var} is not set: run deploy/smoke/smoke.sh (it builds the images)")
    return ref


@pytest.fixture(scope="session")
def image() -> str:
    """The CPU image (localhost/dmuond:...)."""
    return _image("DMUON_IMAGE")


@pytest.fixture(scope="session")
def image_ref() -> str:
    """The CPU image's reference (localhost/dmuond:<version>-<hash>); the
    tests run `image`, its id, which another checkout's build cannot move."""
    return _image("DMUON_IMAGE_REF")


@pytest.fixture(scope="session")
def cuda_image() -> str:
    """The CUDA image (localhost/dmuond-cuda:...); skipped, with the reason,
    on a machine without the CUDA toolkit (smoke.sh leaves it unset)."""
    ref = os.environ.get("DMUON_CUDA_IMAGE", "")
    if not ref:
        pytest.skip("no dmuond-cuda image: no CUDA toolkit to build it with")
    return ref


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT
